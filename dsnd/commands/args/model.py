"""``dsnd model list | show NAME``."""

from __future__ import annotations

import argparse


def add_arguments(model: argparse.ArgumentParser) -> None:
    model_what = model.add_subparsers(dest="model_command", required=True)
    model_what.add_parser("list", help="every shipped preset with its parameter count")
    show = model_what.add_parser("show", help="parameters (exact) and the per-layer table")
    show.add_argument("name", metavar="NAME|DIR", help="a preset, model directory or config.json")
