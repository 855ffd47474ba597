"""``dsnd bench pipeline | partition | context | ...``: measure dsnd's pipeline, its schedules,
its measured partition and its context parallelism on this machine (`BENCHES` lists them all).

A benchmark, not a test: it prints each metric with its target and whether the target was met,
and exits 0 whenever the measurement itself ran. It starts its own gloo ranks (one thread each,
loopback), which run `dsnd.bench.pipeline_rank`: first 2 ranks (dsnd against DeepSpeed's
`PipelineEngine`, dsnd's schedules against its 1F1B at pp=2), then 4 ranks (the same at pp=4,
with fewer repetitions: 4 ranks share this machine's cores). Rank 0
of each writes its raw numbers to a temporary JSON that this process turns into rows
(`dsnd.bench.results`).

``dsnd bench partition`` compares ``parallel.partition: profile`` with ``parameters`` on a model
with a large vocabulary head at pp=4: it measures the profile here (`measure_profile`), then
runs `dsnd.bench.partition_rank` on 4 ranks, which step both layouts in turn and report each
stage's forward and backward compute.

``dsnd bench context`` runs `dsnd.bench.context_rank` on 4 ranks: per sequence length, cp=1
(whole sequences) against ring and Ulysses at cp=2 and 4, each rank's peak activation bytes and
the seconds per step (`dsnd.bench.context_results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

from dsnd.errors import UserError

RANK_MODULE = "dsnd.bench.pipeline_rank"
PARTITION_MODULE = "dsnd.bench.partition_rank"
CONTEXT_MODULE = "dsnd.bench.context_rank"
TIMEOUT_S = 1200  # per phase
PP4_SHARE = 4  # the pp=4 phase runs 1/4 of the repetitions
PARTITION_SHARE = 2  # the partition bench runs 1/2 of them, each a step of both layouts


DEFAULT_REPS = {
    "pipeline": (40, 10),
    "partition": (40, 10),
    "context": (3, 1),
    "zero-memory": (1, 1),
    "activation-checkpointing": (10, 1),
    "overhead": (40, 5),
    "zero-comm": (1, 1),
    "tp-comm": (1, 0),
    "gpu": (8, 2),
    "moe": (10, 2),
    "checkpoint": (3, 1),
}
"""(timed, warm-up) repetitions of each bench unless --steps / --warmup say otherwise: a context
step at 8192 tokens takes seconds, a pipeline step of the tiny model milliseconds."""


def _check(args: argparse.Namespace) -> None:
    steps, warmup = DEFAULT_REPS.get(args.name, DEFAULT_REPS["pipeline"])
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.micro_batches < 1:
        raise UserError(f"--micro-batches must be >= 1, got {args.micro_batches}")


def _ranks(
    module: str,
    world: int,
    out: str,
    steps: int,
    warmup: int,
    micro_batches: int,
    extra: Sequence[str] = (),
) -> dict:
    """Run rank program `module` on `world` ranks; the raw JSON its rank 0 wrote to `out`."""
    from dsnd.launcher.local_ranks import run_ranks

    argv = [
        "-m",
        module,
        out,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--micro-batches",
        str(micro_batches),
        *extra,
    ]
    run_ranks(world, argv, TIMEOUT_S)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _phase(
    name: str, world: int, out: str, args: argparse.Namespace, steps: int, warmup: int
) -> dict:
    """Run one phase of the pipeline rank program on `world` ranks; its raw JSON."""
    extra = ["--phase", name, *(f"--set={item}" for item in args.sets)]
    return _ranks(RANK_MODULE, world, out, steps, warmup, args.micro_batches, extra)


def share_reps(steps: int, warmup: int, share: int) -> tuple[int, int]:
    """(timed, warm-up) repetitions for a phase that runs 1/`share` of them (at least one
    timed; warm-up rounded up)."""
    return max(1, steps // share), -(-warmup // share)


def pp4_reps(steps: int, warmup: int) -> tuple[int, int]:
    """(timed, warm-up) repetitions of the pp=4 phase: a quarter of the pp=2 phase's (4 ranks on
    2 cores make each step several times slower; its bubbles are context, not a target, as a
    rank waiting for a core idles like one waiting for a message)."""
    return share_reps(steps, warmup, PP4_SHARE)


def _pipeline(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.results import PP4_WORLD, WORLD, pipeline_rows

    raw = _phase("pipeline", WORLD, os.path.join(tmp, "raw.json"), args, args.steps, args.warmup)
    steps, warmup = pp4_reps(args.steps, args.warmup)
    raw["pp4"] = _phase("pp4", PP4_WORLD, os.path.join(tmp, "pp4.json"), args, steps, warmup)
    return pipeline_rows(raw)


def measure_profile(micro_batches: int, log_dir: str, sets: Sequence[str]) -> None:
    """Resolve both runs of ``dsnd bench partition`` once in this process, one thread like each
    rank: the profile run measures its layers into ``log_dir/profile-cache``, which every rank
    then reads, so all of them resolve the same stage boundaries (`StageRunner` checks)."""
    import torch

    from dsnd.bench.partition_rank import partition_configs
    from dsnd.bench.partition_results import PARTITION_WORLD

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        partition_configs(PARTITION_WORLD, micro_batches, log_dir, sets)
    finally:
        torch.set_num_threads(threads)


def _partition(args: argparse.Namespace, tmp: str) -> list:
    """``dsnd bench partition``: the profile measured here, then both layouts on 4 ranks, for
    half the repetitions (each repetition steps both)."""
    from dsnd.bench.partition_results import PARTITION_WORLD, partition_rows

    measure_profile(args.micro_batches, tmp, args.sets)
    steps, warmup = share_reps(args.steps, args.warmup, PARTITION_SHARE)
    extra = ["--log-dir", tmp, *(f"--set={item}" for item in args.sets)]
    raw = _ranks(
        PARTITION_MODULE,
        PARTITION_WORLD,
        os.path.join(tmp, "raw.json"),
        steps,
        warmup,
        args.micro_batches,
        extra,
    )
    return partition_rows(raw)


def _context(args: argparse.Namespace, tmp: str) -> list:
    """``dsnd bench context``: the five layouts per sequence length on 4 ranks."""
    from dsnd.bench.context_rank import CONTEXT_WORLD
    from dsnd.bench.context_results import context_rows

    extra = ["--seqs", args.seqs, *(f"--set={item}" for item in args.sets)]
    raw = _ranks(
        CONTEXT_MODULE,
        CONTEXT_WORLD,
        os.path.join(tmp, "raw.json"),
        args.steps,
        args.warmup,
        args.micro_batches,
        extra,
    )
    return context_rows(raw)


def _moe(args: argparse.Namespace, tmp: str) -> list:
    """``dsnd bench moe``: the grouped experts against the loop in this process, then expert
    parallelism at ep=1, 2, 4 on 4 ranks."""
    from dsnd.bench.ep_rank import EP_WORLD
    from dsnd.bench.ep_results import ep_rows
    from dsnd.bench.moe import grouped_rows

    extra = [f"--set={item}" for item in args.sets]
    raw = _ranks(
        "dsnd.bench.ep_rank",
        EP_WORLD,
        os.path.join(tmp, "ep.json"),
        args.steps,
        args.warmup,
        args.micro_batches,
        extra,
    )
    return grouped_rows(args) + ep_rows(raw)


BENCHES: dict[str, tuple[str, str]] = {
    "gpu": (
        "dsnd.bench.gpu:gpu",
        "one GPU (skipped without CUDA): tokens/s, MFU and peak memory / the plan's, bf16, "
        "ZeRO 0/1/3, activation checkpointing on and off",
    ),
    "pipeline": (
        "dsnd.commands.bench:_pipeline",
        "dsnd's pipeline and schedules against DeepSpeed's",
    ),
    "partition": (
        "dsnd.commands.bench:_partition",
        "parallel.partition profile against parameters on a large-vocabulary model at pp=4",
    ),
    "context": (
        "dsnd.commands.bench:_context",
        "activation memory per rank and speed of ring and Ulysses context parallelism at "
        "cp=1/2/4 on long sequences",
    ),
    "zero-comm": (
        "dsnd.commands.bench_comm:zero_comm",
        "data-parallel bytes per step at ZeRO 1-3 against theory",
    ),
    "tp-comm": (
        "dsnd.commands.bench_comm:tp_comm",
        "tensor-parallel collectives per block against Megatron's",
    ),
    "zero-memory": (
        "dsnd.commands.bench_memory:zero_memory",
        "model-state bytes per rank at ZeRO 0-3 inside pipeline stages against the formula",
    ),
    "activation-checkpointing": (
        "dsnd.commands.bench_memory:activation_checkpointing",
        "activation memory and step time with activation checkpointing on against off",
    ),
    "moe": (
        "dsnd.commands.bench:_moe",
        "one MoE layer's experts as a grouped matmul against a per-expert loop (8 experts); "
        "expert parallelism's all-to-all bytes against the formula and throughput at ep=1/2/4",
    ),
    "overhead": (
        "dsnd.commands.bench_memory:overhead",
        "dsnd's throughput at world 1 against a plain PyTorch loop on the same model",
    ),
    "checkpoint": (
        "dsnd.commands.bench_memory:checkpoint",
        "the step time during a checkpoint save ÷ without one, synchronous and checkpoint.async",
    ),
}
"""Each bench: its measuring function as ``module:function`` (taking the parsed arguments and a
temporary directory, returning its rows; imported only when that bench runs) and its help."""


def _measure(name: str):
    import importlib

    module, function = BENCHES[name][0].split(":")
    return getattr(importlib.import_module(module), function)


def run_bench(args: argparse.Namespace) -> int:
    _check(args)
    from dsnd.bench.rows import Skipped, format_table, json_lines
    from dsnd.launcher.local_ranks import RanksFailed

    measure = _measure(args.name)
    with tempfile.TemporaryDirectory(prefix="dsnd-bench-") as tmp:
        try:
            rows = measure(args, tmp)
        except RanksFailed as e:
            print(f"dsnd: bench {args.name} failed: {e}", file=sys.stderr)
            return 1
        except Skipped as e:
            print(f"dsnd bench {args.name}: skipped: {e}")
            return 0
    print(json_lines(rows) if args.json else format_table(rows))
    return 0
