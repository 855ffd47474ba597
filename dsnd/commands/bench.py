"""``dsnd bench pipeline``: measure dsnd's pipeline, its schedules and ZeRO on this machine.

A benchmark, not a test: it prints each metric with its target and whether the target was met,
and exits 0 whenever the measurement itself ran. It starts its own gloo ranks (one thread each,
loopback), which run `dsnd.bench.pipeline_rank`: first 2 ranks (dsnd against DeepSpeed's
`PipelineEngine`, dsnd's schedules against its 1F1B at pp=2, ZeRO memory), then 4 ranks (the
schedules' bubbles at pp=4, with fewer repetitions: 4 ranks share this machine's cores). Rank 0
of each writes its raw numbers to a temporary JSON that this process turns into rows
(`dsnd.bench.results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from dsnd.errors import UserError

RANK_MODULE = "dsnd.bench.pipeline_rank"
TIMEOUT_S = 1200  # per phase
PP4_SHARE = 4  # the pp=4 phase runs 1/4 of the repetitions


def _check(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.micro_batches < 1:
        raise UserError(f"--micro-batches must be >= 1, got {args.micro_batches}")


def _phase(name: str, world: int, out: str, args: argparse.Namespace, steps: int,
           warmup: int) -> dict:  # fmt: skip
    """Run one phase of the rank program on `world` ranks; its raw JSON."""
    from dsnd.launch.local_ranks import run_ranks

    argv = ["-m", RANK_MODULE, out, "--phase", name, "--steps", str(steps), "--warmup",
            str(warmup), "--micro-batches", str(args.micro_batches)]  # fmt: skip
    run_ranks(world, argv, TIMEOUT_S)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def pp4_reps(steps: int, warmup: int) -> tuple[int, int]:
    """(timed, warm-up) repetitions of the pp=4 phase: a quarter of the pp=2 phase's (4 ranks on
    2 cores make each step several times slower; its bubbles are context, not a target)."""
    return max(1, steps // PP4_SHARE), -(-warmup // PP4_SHARE)


def run_bench(args: argparse.Namespace) -> int:
    _check(args)
    from dsnd.bench.results import PP4_WORLD, WORLD, format_table, json_lines, pipeline_rows
    from dsnd.launch.local_ranks import RanksFailed

    with tempfile.TemporaryDirectory(prefix="dsnd-bench-") as tmp:
        try:
            raw = _phase("pipeline", WORLD, os.path.join(tmp, "raw.json"), args, args.steps,
                         args.warmup)  # fmt: skip
            steps, warmup = pp4_reps(args.steps, args.warmup)
            raw["pp4"] = _phase("pp4", PP4_WORLD, os.path.join(tmp, "pp4.json"), args, steps,
                                warmup)  # fmt: skip
        except RanksFailed as e:
            print(f"dsnd: bench {args.name} failed: {e}", file=sys.stderr)
            return 1
    rows = pipeline_rows(raw)
    print(json_lines(rows) if args.json else format_table(rows))
    return 0
