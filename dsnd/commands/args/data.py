"""``dsnd data prepare INPUT OUT``."""

from __future__ import annotations

import argparse


def add_arguments(data: argparse.ArgumentParser) -> None:
    data_what = data.add_subparsers(dest="data_command", required=True)
    prepare = data_what.add_parser("prepare", help="tokenize a text/JSONL file into OUT.bin")
    prepare.add_argument("source", metavar="INPUT", help="a text or JSONL file")
    prepare.add_argument("out", metavar="OUT", help="the token file to write (e.g. train.bin)")
    prepare.add_argument("--format", default="auto", choices=("auto", "text", "jsonl"))
    prepare.add_argument("--text-field", default="text", help="JSONL field with the text")
    prepare.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default) or a local transformers tokenizer directory",
    )
