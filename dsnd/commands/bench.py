"""``dsnd bench pipeline``: measure dsnd's pipeline and ZeRO against DeepSpeed on this machine.

A benchmark, not a test: it prints each metric with its target and whether the target was met,
and exits 0 whenever the measurement itself ran. It starts its own 2 gloo ranks (one thread each,
loopback), which run `dsnd.bench.pipeline_rank`; rank 0 writes the raw numbers to a temporary
JSON that this process turns into rows (`dsnd.bench.results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from dsnd.errors import UserError

RANK_MODULE = "dsnd.bench.pipeline_rank"
TIMEOUT_S = 1200


def _check(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.micro_batches < 1:
        raise UserError(f"--micro-batches must be >= 1, got {args.micro_batches}")


def run_bench(args: argparse.Namespace) -> int:
    _check(args)
    from dsnd.bench.results import WORLD, format_table, json_lines, pipeline_rows
    from dsnd.launch.local_ranks import RanksFailed, run_ranks

    with tempfile.TemporaryDirectory(prefix="dsnd-bench-") as tmp:
        out = os.path.join(tmp, "raw.json")
        argv = ["-m", RANK_MODULE, out, "--steps", str(args.steps), "--warmup",
                str(args.warmup), "--micro-batches", str(args.micro_batches)]  # fmt: skip
        try:
            run_ranks(WORLD, argv, TIMEOUT_S)
        except RanksFailed as e:
            print(f"dsnd: bench {args.name} failed: {e}", file=sys.stderr)
            return 1
        with open(out, encoding="utf-8") as f:
            raw = json.load(f)
    rows = pipeline_rows(raw)
    print(json_lines(rows) if args.json else format_table(rows))
    return 0
