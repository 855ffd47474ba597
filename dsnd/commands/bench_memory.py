"""The measuring functions of ``dsnd bench zero-memory | activation-checkpointing | overhead``
(registered in `dsnd.commands.bench.BENCHES`): each runs its rank program and turns rank 0's raw
JSON into rows.

- zero-memory: `dsnd.bench.zero_memory_rank` on 4 ranks (pp=2 x dp=2, ZeRO 0-3), rows by
  `dsnd.bench.memory_results.zero_memory_rows`;
- activation-checkpointing: `dsnd.bench.checkpointing_rank` on 1 rank, rows by
  `dsnd.bench.memory_results.checkpointing_rows`;
- overhead: `dsnd.bench.overhead_rank` on 1 rank, rows by
  `dsnd.bench.overhead_results.overhead_rows`;
- checkpoint: `dsnd.bench.checkpoint_rank` on 1 rank, rows by
  `dsnd.bench.checkpoint_results.checkpoint_rows`.
"""

from __future__ import annotations

import argparse
import os

from dsnd.commands.bench import _ranks


def _sets(args: argparse.Namespace) -> list[str]:
    return [f"--set={item}" for item in args.sets]


def zero_memory(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.memory_results import zero_memory_rows
    from dsnd.bench.zero_memory_rank import ZERO_WORLD

    raw = _ranks(
        "dsnd.bench.zero_memory_rank",
        ZERO_WORLD,
        os.path.join(tmp, "raw.json"),
        args.steps,
        args.warmup,
        args.micro_batches,
        _sets(args),
    )
    return zero_memory_rows(raw)


def activation_checkpointing(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.checkpointing_rank import CHECKPOINTING_WORLD
    from dsnd.bench.memory_results import checkpointing_rows

    raw = _ranks(
        "dsnd.bench.checkpointing_rank",
        CHECKPOINTING_WORLD,
        os.path.join(tmp, "raw.json"),
        args.steps,
        args.warmup,
        args.micro_batches,
        _sets(args),
    )
    return checkpointing_rows(raw)


def _with_log_dir(args: argparse.Namespace, tmp: str, module: str, world: int) -> dict:
    """The raw results of a bench whose ranks train a run that writes under `--log-dir`."""
    extra = ["--log-dir", os.path.join(tmp, "run"), *_sets(args)]
    raw_path = os.path.join(tmp, "raw.json")
    return _ranks(module, world, raw_path, args.steps, args.warmup, args.micro_batches, extra)


def overhead(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.overhead_rank import OVERHEAD_WORLD
    from dsnd.bench.overhead_results import overhead_rows

    return overhead_rows(_with_log_dir(args, tmp, "dsnd.bench.overhead_rank", OVERHEAD_WORLD))


def checkpoint(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.checkpoint_rank import CHECKPOINT_WORLD
    from dsnd.bench.checkpoint_results import checkpoint_rows

    return checkpoint_rows(_with_log_dir(args, tmp, "dsnd.bench.checkpoint_rank", CHECKPOINT_WORLD))
