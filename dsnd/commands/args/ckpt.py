"""``dsnd ckpt inspect | verify | export | import``."""

from __future__ import annotations

import argparse

from dsnd.commands.args.common import add_config_args


def add_arguments(ckpt: argparse.ArgumentParser) -> None:
    what = ckpt.add_subparsers(dest="ckpt_command", required=True)
    where_help = "a checkpoint root (its 'latest') or a step directory"
    inspect = what.add_parser("inspect", help="manifest summary and every file's checksum")
    inspect.add_argument("dir", help=where_help)
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    verify = what.add_parser(
        "verify",
        help="check every file's size and SHA-256, the manifest, the tensor headers and that "
        "every value is finite",
    )
    verify.add_argument("dir", help=where_help)
    export = what.add_parser("export", help="write the weights as a transformers directory")
    export.add_argument("dir", help=where_help)
    export.add_argument("out", help="new (or empty) output directory")
    imp = what.add_parser(
        "import",
        help="convert a checkpoint DeepSpeed's engine saved (ZeRO 1-3, pipeline or not) into a "
        "dsnd checkpoint of the run config's model",
    )
    imp.add_argument(
        "dir",
        metavar="DS_CHECKPOINT_DIR",
        help="the directory save_checkpoint wrote (its 'latest' tag) or one tag",
    )
    imp.add_argument("out", metavar="OUT", help="new (or empty) dsnd checkpoint root")
    add_config_args(imp)
