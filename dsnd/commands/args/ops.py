"""``dsnd ops build [BUILDER ...]``."""

from __future__ import annotations

import argparse


def add_arguments(ops: argparse.ArgumentParser) -> None:
    ops_what = ops.add_subparsers(dest="ops_command", required=True)
    build = ops_what.add_parser("build", help="compile the ops dsnd uses now, not at first launch")
    build.add_argument(
        "names",
        nargs="*",
        metavar="BUILDER",
        help="DeepSpeed builder class names (default: on the CPU all dsnd "
        "uses; on CUDA those the --deepspeed JSON needs)",
    )
    build.add_argument(
        "--deepspeed",
        metavar="JSON",
        help="the DeepSpeed JSON the runs will use: on CUDA only the ops it needs "
        "are built (default: the packaged default run's, zero0.json)",
    )
