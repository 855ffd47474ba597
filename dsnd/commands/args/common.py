"""Arguments several commands share."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set``: the run YAML and its overrides, as train, launch and
    ckpt import read them."""
    p.add_argument("--config", help="run YAML (default: the packaged llama-tiny config)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run key, or a DeepSpeed key as ds.KEY=VALUE (repeatable)",
    )
