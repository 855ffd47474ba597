"""``dsnd data prepare INPUT OUT`` and ``dsnd data verify PATH``."""

from __future__ import annotations

import argparse

FORMATS = ("auto", "text", "jsonl", "hf", "chat")


def add_arguments(data: argparse.ArgumentParser) -> None:
    data_what = data.add_subparsers(dest="data_command", required=True)
    prepare = data_what.add_parser(
        "prepare",
        help="tokenize a text/JSONL file, a dataset or chat data into OUT.bin",
        description="Tokenize INPUT once into OUT (token ids) and OUT.json (what they are), "
        "streamed in bounded memory; also OUT.docs (each document's first token) and, for chat "
        "data, OUT.mask (which tokens count in the loss). See docs/data.md.",
    )
    prepare.add_argument(
        "source",
        metavar="INPUT",
        help="a text file (one document), JSONL (a document per line), a Hugging Face dataset "
        "(a save_to_disk directory, .parquet, .arrow) or chat data",
    )
    prepare.add_argument(
        "out", metavar="OUT", nargs="?", help="the token file to write (e.g. train.bin)"
    )
    prepare.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="auto (by extension; default), text, jsonl, hf, or chat: a messages list of "
        "{role, content} per JSONL line or dataset row, rendered with the tokenizer's chat "
        "template; only the assistant's tokens count",
    )
    prepare.add_argument("--text-field", default="text", help="JSONL field / dataset column")
    prepare.add_argument("--split", default="train", help="a DatasetDict's split (default train)")
    prepare.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default) or a local transformers tokenizer directory",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="processes that tokenize (default: the CPUs, at most 8; bytes need none); the "
        "output is the same for any N",
    )
    prepare.add_argument(
        "--preview",
        type=int,
        default=0,
        metavar="N",
        help="print the first N documents as they would be written, the tokens not counted in "
        "the loss in [[...]], and write nothing (OUT may be left out)",
    )
    verify = data_what.add_parser(
        "verify",
        help="read a token file whole and check it against its sidecar",
        description="Read every byte of a token file and its .docs/.mask: the SHA-256 its "
        "sidecar records, every id below its vocabulary, document starts strictly increasing, "
        "mask values 0 or 1 and their count. Training's start reads none of this (it takes the "
        "sidecar's word); run it after copying a corpus. See docs/data.md.",
    )
    verify.add_argument("path", metavar="PATH", help="the token file (e.g. train.bin)")
