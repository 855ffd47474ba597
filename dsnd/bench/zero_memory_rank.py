"""Rank program of ``dsnd bench zero-memory``; run by every rank of a 4-rank gloo world::

    python -m dsnd.bench.zero_memory_rank OUT.json [--steps N] [--warmup W] [--set KEY=VALUE ...]

pp=2 x dp=2 on the default tiny model (the shipped ZeRO JSONs: fp32, AdamW, 16 samples per step
in micro-batches of 2), ZeRO 0, 1, 2 and 3 in turn (ZeRO-3 with
``stage3_param_persistence_threshold: 0``: every parameter partitioned). Each stage is one
`StageRunner`, exactly what the trainer runs. After `warmup` steps (at least one, so the
optimizer's state exists), during `steps` more, the model-state bytes this rank holds
(`dsnd.engine.memory.state_bytes`: parameters, gradients, fp32 master, optimizer state) are read
after every backward, after the step's gradient reduction and after the optimizer step: the
points where model state changes size (ZeRO-3's gathered parameters live only inside a layer's
forward or backward and are not model state). ``--micro-batches`` is not used: the JSONs' batch
holds.

Rank 0 writes, per ZeRO stage and rank, the rank's pipeline stage, that stage's parameters (the
plan's `stage_parameters`), its data-parallel size and the bytes at each point to OUT.json;
`dsnd.bench.memory_results` compares them with `dsnd.plan.memory.model_state_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from dsnd.bench import rank
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import run_groups
from dsnd.engine.memory import state_bytes
from dsnd.engine.optimizers import state_bytes as optimizer_state_bytes

ZERO_WORLD = 4
ZERO_STAGES = (0, 1, 2, 3)
LAYOUT = ("parallel.pp=2", "parallel.partition=parameters")
PROBED = (
    "backward_loss",
    "backward_output",
    "backward_loss_plain",
    "backward_plain",
    "backward_weight",
    "reduce",
    "step",
)
"""The `StageEngine` calls after which model state is read: every backward (through DeepSpeed's
or, where `StageEngine.plain`, torch's), the reduction, the optimizer step."""


def zero_sets(stage: int, extra: Sequence[str] = ()) -> list[str]:
    sets = [f"deepspeed={rank.ds_json(stage)}", *LAYOUT]
    if stage == 3:
        sets.append("ds.zero_optimization.stage3_param_persistence_threshold=0")
    return [*sets, *extra]


def zero_configs(world: int, extra: Sequence[str] = ()) -> dict[int, Resolved]:
    return {stage: resolve(load(None, zero_sets(stage, extra)), world) for stage in ZERO_STAGES}


class StateProbe:
    """Reads `state_bytes` of a `StageEngine`'s DeepSpeed engine after each of its `PROBED`
    calls while `on`, by wrapping those methods on this one instance: the step itself runs
    unchanged (the wrapper calls the method, then only reads)."""

    def __init__(self, stage_engine) -> None:
        self.on = False
        self.points: list[tuple[str, dict[str, int]]] = []
        for name in PROBED:
            method = getattr(stage_engine, name)
            setattr(stage_engine, name, self._after(name, method, stage_engine.engine))

    def _after(self, name: str, method: Callable, engine) -> Callable:
        def probed(*args, **kwargs):
            out = method(*args, **kwargs)
            if self.on:
                self.points.append((name, state_bytes(engine)))
            return out

        return probed


def measure(res: Resolved, steps: int, warmup: int) -> dict[str, Any]:
    """This rank's stage, its parameters and data-parallel size, and the model-state bytes at
    every probed point of the measured steps."""
    groups = run_groups(res)
    samples = rank.sample_set(res)
    with rank.stage_runner(res, groups) as runner:
        probe = StateProbe(runner.executor.engine)
        for step in range(warmup + steps):
            probe.on = step >= warmup
            runner.run(rank.step_batches(res, samples, groups, step))
        stage = groups.coord.pp
        return {
            "stage": stage,
            "psi": res.plan.stage_parameters(res.model)[stage],
            "nd": zero_ranks(res),
            "points": probe.points,
        }


def zero_ranks(res: Resolved) -> int:
    """The ranks ZeRO partitions a stage's states over: the stage's data x context ranks, or
    at ZeRO-3 with ``parallel.dp_shard`` its shard group (as ``dsnd ds-config explain``)."""
    t = res.topology
    return t.dp_shard or t.dp * t.cp  # (dp_shard: 0 without hybrid sharding, which is ZeRO-3)


def layout(res: Resolved) -> dict[str, Any]:
    optimizer, per_param = optimizer_state_bytes(res.ds["optimizer"], offload=False)
    bf16 = bool((res.ds.get("bf16") or {}).get("enabled"))
    return {
        "pp": res.topology.pp,
        "dp": res.topology.dp,
        "model": res.model.describe(),
        "batch": str(res.batch),
        "seq_len": res.run.model.seq_len,
        "bf16": bf16,
        "optimizer": optimizer,
        "state_bytes": per_param,
    }


def zero_raw(runs: dict[int, Resolved], steps: int, warmup: int) -> dict[str, Any] | None:
    """Every ZeRO stage measured in turn; on rank 0 the raw JSON of every rank's numbers."""
    mine = {str(stage): measure(res, steps, warmup) for stage, res in runs.items()}
    gathered = rank.gather(mine)
    if dist.get_rank() != 0:
        return None
    return {
        "layout": layout(runs[0]),
        "warmup": warmup,
        "steps": steps,
        "stages": {str(s): [g[str(s)] for g in gathered] for s in ZERO_STAGES},
    }


def main(argv: list[str] | None = None) -> None:
    args = rank.parser("dsnd.bench.zero_memory_rank", steps=1, warmup=1).parse_args(argv)
    warmup = max(1, args.warmup)  # the optimizer's state exists from the first step on
    rank.run(
        args.out,
        "dsnd bench zero-memory",
        ZERO_WORLD,
        lambda: zero_configs(ZERO_WORLD, args.sets),
        lambda runs: zero_raw(runs, args.steps, warmup),
    )


if __name__ == "__main__":
    main()
