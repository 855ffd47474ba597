"""``dsnd plot LOG_DIR ... -o PNG``."""

from __future__ import annotations

import argparse


def add_arguments(plot: argparse.ArgumentParser) -> None:
    plot.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="a run's log.dir")
    plot.add_argument("-o", "--out", required=True, help="the PNG to write")
