"""Each command's argparse arguments, one module per command (``add_arguments(parser)``).

They import nothing heavy: ``dsnd --help`` builds every command's parser without importing torch
or DeepSpeed, and ``dsnd`` can pin the accelerator and the ops' environment directory before the
command's own module imports DeepSpeed.
"""
