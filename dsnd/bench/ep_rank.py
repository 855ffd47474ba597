"""Rank program of ``dsnd bench moe``'s expert-parallel part::

    python -m dsnd.bench.ep_rank OUT.json [--steps N] [--warmup W] [--set KEY=VALUE ...]

Mixtral-tiny (4 experts per layer, top-2) on 4 ranks (dp=4, ZeRO-1, fp32, `EP_MICRO_BATCHES`
micro-batches per step) at ep=1, 2 and 4, and at ep=2 with ZeRO 0, 2 and 3 (for their model-
state bytes): `StageRunner`s (what the trainer runs) built side by side on the same ranks,
stepped in turns on the same batches (`rank.take_turns`), each step timed; then one more step of
each inside a `dsnd.bench.comm_count.CommCounter`, which sees every collective: the experts'
all-to-alls and ZeRO's data-parallel traffic apart. Per run each rank records its step times,
the counted step's all-to-all calls and payload bytes and its other collectives' bytes, its peak
model-state bytes in the step (`dsnd.bench.zero_memory_rank.StateProbe`) and the losses; rank 0
writes them all to OUT.json (`dsnd.bench.ep_results` makes the rows).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dsnd.bench import rank
from dsnd.bench.comm_count import CommCounter
from dsnd.bench.memory_results import peak_point
from dsnd.bench.zero_memory_rank import StateProbe
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import run_groups
from dsnd.model.moe_config import num_experts
from dsnd.moe import moe_experts
from dsnd.pipeline.runner import StageRunner

EP_WORLD = 4
EP_SIZES = (1, 2, 4)
STATE_STAGES = (0, 2, 3)
"""ZeRO stages besides 1 run at ep=2 for their model-state bytes against the formula (fp32;
ZeRO 1 and 3 also in bf16: `_bf16` runs)."""
EP_MICRO_BATCHES = 2


def run_sets(ep: int, stage: int = 1) -> list[str]:
    sets = [
        "model.preset=mixtral-tiny",
        f"deepspeed={rank.ds_json(stage)}",
        "ds.train_batch_size=null",
        f"ds.gradient_accumulation_steps={EP_MICRO_BATCHES}",
        f"parallel.ep={ep}",
    ]
    if stage == 3:  # else the tiny model's tensors all stay whole (persistent)
        sets.append("ds.zero_optimization.stage3_param_persistence_threshold=0")
    return sets


def runs(extra: Sequence[str]) -> dict[str, Resolved]:
    """ep=1, 2, 4 at ZeRO-1 (named ep<n>), and ep=2 at the `STATE_STAGES` (ep2_zero<s>) and
    in bf16 (ep2_zero<s>_bf16)."""
    out = {f"ep{ep}": run_sets(ep) for ep in EP_SIZES}
    out |= {f"ep2_zero{stage}": run_sets(2, stage) for stage in STATE_STAGES}
    out |= {
        f"ep2_zero{stage}_bf16": [*run_sets(2, stage), "ds.bf16.enabled=true"] for stage in (1, 3)
    }
    return {name: resolve(load(None, [*sets, *extra]), EP_WORLD) for name, sets in out.items()}


def layout(res: Resolved, runner: StageRunner) -> dict[str, Any]:
    """The run's shape for the formula; its MoE layers counted in the built stage (pp=1)."""
    cfg = res.model.config
    moe_layers = sum(
        moe_experts(layer) is not None for layer in runner.engine.module.layers.values()
    )
    return {
        "ep": res.topology.ep,
        "dp": res.topology.dp,
        "micro": res.batch.micro,
        "params": res.plan.stage_parameters(res.model)[0],
        "expert_params": res.plan.stage_experts(res.model)[0],
        "zero_stage": res.plan.zero_stage,
        "state_per_param": 8,  # AdamW's two fp32 moments
        "bf16": bool((res.ds.get("bf16") or {}).get("enabled")),
        "micro_batches": res.batch.gas,
        "seq_len": res.run.model.seq_len,
        "hidden": res.model.hidden_size,
        "moe_layers": moe_layers,
        "experts": num_experts(cfg),
        "top_k": cfg.num_experts_per_tok,
        "element_bytes": 4,
    }


def _counted(runner: StageRunner, micro) -> dict[str, Any]:
    """One step counted: its collectives, and its peak of model-state bytes (of the points
    `StateProbe` reads: after each backward, the reduction and the optimizer step)."""
    counter, probe = CommCounter(), StateProbe(runner.executor.engine)
    probe.on = True
    with counter:
        runner.run(micro)
    a2a = [c for c in counter.calls if c.op == "all_to_all"]
    return {
        "a2a_calls": len(a2a),
        "a2a_payload": sum(c.payload for c in a2a),
        "other_sent": sum(c.sent for c in counter.calls if c.op != "all_to_all"),
        "state": dict(peak_point(probe.points)[1]),
    }


def measure(runs: dict[str, Resolved], steps: int, warmup: int) -> dict[str, Any]:
    first = next(iter(runs.values()))
    samples = rank.sample_set(first)
    runners = {}
    for name, res in runs.items():
        runners[name] = StageRunner(res, run_groups(res), load_hf=False)
    groups = run_groups(first)
    losses: dict[str, list[float]] = {name: [] for name in runs}

    def step(name: str, micro) -> dict[str, Any]:
        dist.barrier()
        start = time.perf_counter()
        result = runners[name].run(micro)
        seconds = time.perf_counter() - start
        losses[name].append(runners[name].report(result)[0])
        return {"seconds": seconds}

    try:
        reps = rank.take_turns(
            list(runs), steps, warmup, lambda r: rank.step_batches(first, samples, groups, r), step
        )
        micro = rank.step_batches(first, samples, groups, warmup + steps)
        mine = {
            name: {
                "times": [r["runs"][name]["seconds"] for r in reps if r["timed"]],
                **_counted(runner, micro),
                "losses": losses[name],
            }
            for name, runner in runners.items()
        }
        layouts = {name: layout(res, runners[name]) for name, res in runs.items()}
    finally:
        for runner in runners.values():
            runner.engine.destroy()
    return {"layouts": layouts, "ranks": rank.gather(mine)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.ep_rank", steps=5, warmup=1)
    args = parser.parse_args(argv)
    rank.run(
        args.out,
        "expert parallelism",
        EP_WORLD,
        lambda: runs(args.sets),
        lambda runs: measure(runs, args.steps, args.warmup),
    )


if __name__ == "__main__":
    main()
