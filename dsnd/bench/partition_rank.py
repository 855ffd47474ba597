"""Rank program of ``dsnd bench partition``; run by every rank of a 4-rank gloo world::

    python -m dsnd.bench.partition_rank OUT.json --log-dir DIR [--steps N] [--warmup W]
                                         [--micro-batches M] [--set KEY=VALUE ...]

Two runs identical but for ``parallel.partition`` (``parameters``: DeepSpeed's balance of
parameter counts; ``profile``: dsnd's balance of measured layer times) on a model with a large
vocabulary head (`SHAPE`) at pp=4 x dp=1, 1F1B, each a `StageRunner` in these processes
(`bench_schedules` of ``dsnd bench pipeline``): repetition r runs step r's batches on both, in
alternating order, each step timed from a common barrier, with its seconds per phase
(`StepResult.times`: the stage's forward and backward compute, receive waits, ...).

Every rank resolves both runs itself, and `StageRunner` checks that all ranks got the same
stage boundaries: the profile's layer costs are cached under ``DIR/profile-cache``, which the
launching process (`dsnd.commands.bench`) fills by resolving the runs once before the ranks
start (`partition_configs`), so every rank reads the same measurement.

Rank 0 writes the raw numbers to OUT.json; `dsnd.bench.partition_results` turns them into rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsnd.bench import rank
from dsnd.bench.partition_results import PARTITION_WORLD, PARTITIONS
from dsnd.bench.pipeline_rank import _pipe_sets, bench_schedules, merge_runs
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve, zero_stage
from dsnd.model import layer_specs
from dsnd.plan.partition import layer_param_counts
from dsnd.plan.profile import GIB, profile_partition

SHAPE = ("model.vocab_size=32000", "model.hidden_size=64", "model.num_layers=4")
"""A large vocabulary head on a small model: the head (and its loss) costs far more time per
parameter than the embedding, which has as many parameters."""
ZERO_STAGE = 0
"""ZeRO-1 refuses both layouts of `SHAPE` at pp=4: DeepSpeed's split puts the embedding and the
head on stages of their own, whose one optimizer parameter group differs from the block stages'
two (`dsnd.plan.plan._check_param_groups`). At dp=1 ZeRO-1 shards nothing, and no ZeRO stage
touches the forward and backward compute this bench compares."""
LAYOUT = ("parallel.pp=4", "parallel.schedule=1f1b", *SHAPE)


def partition_sets(micro_batches: int, log_dir: str, extra: Sequence[str] = ()) -> list[str]:
    """The run keys both runs share: ``dsnd bench pipeline``'s, at pp=4 on `SHAPE`, logging
    (and the profile's cache) under `log_dir`, then the caller's `extra`."""
    return [
        *_pipe_sets(micro_batches),
        f"deepspeed={rank.ds_json(ZERO_STAGE)}",
        *LAYOUT,
        f"log.dir={log_dir}",
        *extra,
    ]


def partition_configs(
    world: int, micro_batches: int, log_dir: str, extra: Sequence[str] = ()
) -> dict[str, Resolved]:
    """One resolved run per partition method of `PARTITIONS`; resolving the ``profile`` run
    measures the layers (or reads ``log_dir/profile-cache``)."""
    base = partition_sets(micro_batches, log_dir, extra)
    return {
        name: resolve(load(None, [*base, f"parallel.partition={name}"]), world)
        for name in PARTITIONS
    }


def layer_table(res: Resolved) -> list[dict[str, Any]]:
    """Per pipeline layer: its kind, parameters, and the profile's measured seconds (forward +
    backward of one micro-batch) and memory, as `run_plan` balanced them (read from the cache
    that resolving `res` filled)."""
    run = res.run
    cap = run.parallel.profile_memory_cap_gb
    cache = os.path.join(run.log.dir, "profile-cache")
    _, costs = profile_partition(
        res.model,
        run.model.seq_len,
        res.batch.micro,
        len(res.plan.parts) - 1,
        cache,
        None if cap is None else int(cap * GIB),
    )
    specs = layer_specs(res.model)
    return [
        {
            "name": spec.typename.__name__,
            "params": params,
            "seconds": cost.seconds,
            "memory_bytes": cost.memory_bytes,
        }
        for spec, params, cost in zip(specs, layer_param_counts(specs), costs, strict=True)
    ]


def partition_raw(
    runs: dict[str, Resolved], per_rank: list[list[dict[str, Any]]], warmup: int
) -> dict[str, Any]:
    """The raw JSON: layout, the profiled layers, each run's stage boundaries, and the
    repetitions with per-rank lists."""
    res = runs["profile"]
    model, batch = res.model, res.batch
    layout = dict(
        pp=res.topology.pp,
        dp=res.topology.dp,
        micro=batch.micro,
        micro_batches=batch.gas,
        seq_len=res.run.model.seq_len,
        model=model.source,
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        blocks=model.num_layers,
        zero_stage=zero_stage(res.ds),
        schedule=res.plan.schedule,
        memory_cap_gb=res.run.parallel.profile_memory_cap_gb,
        tokens_per_step=res.tokens_per_step,
        warmup=warmup,
        ranks=len(per_rank),
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
    )
    return {
        "layout": layout,
        "layers": layer_table(res),
        "parts": {name: list(run.plan.parts) for name, run in runs.items()},
        "reps": merge_runs(list(runs), per_rank),
    }


def measure(runs: dict[str, Resolved], steps: int, warmup: int) -> dict[str, Any] | None:
    """Both runs taking turns; on rank 0 the raw JSON of every rank's records (only rank 0 reads
    the profile's cache for the layer table)."""
    gathered = rank.gather(bench_schedules(runs, steps, warmup))
    return partition_raw(runs, gathered, warmup) if dist.get_rank() == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.partition_rank", steps=10, warmup=3)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    # the profile comes from the launcher's cache
    rank.run(
        args.out,
        "dsnd bench partition",
        PARTITION_WORLD,
        lambda: partition_configs(PARTITION_WORLD, args.micro_batches, args.log_dir, args.sets),
        lambda runs: measure(runs, args.steps, args.warmup),
    )


if __name__ == "__main__":
    main()
