"""``dsnd bench NAME``: which bench (`BENCHES`), its repetitions and run-key overrides."""

from __future__ import annotations

import argparse

from dsnd.commands.bench import BENCHES


def add_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "name",
        choices=tuple(BENCHES),
        help="; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items()),
    )
    bench.add_argument(
        "--steps", type=int, help="timed repetitions per side (default: 40; context: 3)"
    )
    bench.add_argument(
        "--warmup", type=int, help="untimed repetitions first (default: 10; context: 1)"
    )
    bench.add_argument("--micro-batches", type=int, default=8, help="gradient accumulation steps")
    bench.add_argument("--json", action="store_true", help="one JSON object per metric line")
    bench.add_argument(
        "--seqs", default="2048,4096,8192", help="context: the sequence lengths, comma-separated"
    )
    bench.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run key of every run the bench resolves, e.g. model.hidden_size=512 "
        "(repeatable)",
    )
