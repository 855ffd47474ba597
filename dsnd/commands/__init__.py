"""The command line's commands, one module each (their arguments in `args/`)."""
