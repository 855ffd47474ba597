"""``dsnd ds-config check | explain FILE``."""

from __future__ import annotations

import argparse


def add_arguments(ds_config: argparse.ArgumentParser) -> None:
    ds_what = ds_config.add_subparsers(dest="ds_command", required=True)
    for name, text in (
        ("check", "each key: used, filled in, no effect or ignored; every problem at once"),
        ("explain", "check, then batch math, precision, ZeRO, offload, memory"),
    ):
        what = ds_what.add_parser(name, help=text)
        what.add_argument("file", metavar="FILE", help="a DeepSpeed JSON")
        what.add_argument("--config", help="the run YAML (default: dsnd's default run)")
        what.add_argument("--nprocs", type=int, default=1, help="ranks the run has")
        what.add_argument(
            "--set",
            dest="sets",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a run key or ds.KEY (repeatable)",
        )
