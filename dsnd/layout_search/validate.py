"""``dsnd plan --validate``: run layouts here and compare the plan's predictions with what they
measure.

Each layout runs as the files ``--out`` would write (`dsnd.layout_search.emit`), through ``dsnd
train`` on this machine's ranks (gloo, one thread each), for a few steps. Measured memory is the
busiest stage's model-state bytes plus the activations autograd saved (what dsnd's telemetry reports
on a CPU, which keeps no allocator statistics), sampled at the step's end; predicted, the same
parts: parameters, optimizer states, activations and, at ZeRO-3, the gradient partition DeepSpeed
keeps between steps (ZeRO 0-2 free their gradients at each step's end, so neither side has them
there; `dsnd bench zero-memory` checks gradients after a backward). Communication buffers are on
neither side. Measured time is the median step after the first two.

Predicted time: a CPU has no datasheet, so each layer's forward and backward at the layout's
micro-batch is measured here first (`layer_costs`, one thread like a rank) and takes the place
of the FLOP and memory-traffic terms; the pipeline, its schedule's bubble, messages, the ZeRO
reduction and the optimizer pass are the time model's. Its one constant, the efficiency, is
calibrated on the first layout (its time ratio is 1 by construction); the others are
predictions.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import replace
from typing import Any

from dsnd.layout_search import emit
from dsnd.layout_search.hardware import Efficiency
from dsnd.layout_search.search import Layout, Problem, evaluate

TIMEOUT_S = 600
WARM_STEPS = 2  # steps left out of the time median (start-up, first allocations)


BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
"""The process-group backend of each accelerator a layout runs on, named explicitly."""


def run_layout(
    model: str,
    pr: Problem,
    lay: Layout,
    steps: int,
    tmp: str,
    sets: tuple[str, ...] = (),
    accelerator: str = "cpu",
) -> list[dict[str, Any]]:
    """Run the layout for `steps` steps (as ``--out`` writes it, plus run keys `sets`) on this
    machine's ranks, on DeepSpeed's `accelerator` with its backend (`cpu`: gloo, even on a GPU
    machine; `cuda`: nccl); its metrics rows."""
    from dsnd.launcher.local_ranks import run_ranks
    from dsnd.model.source import presets

    out = os.path.join(tmp, lay.key().replace(" ", "_").replace("=", ""))
    emit.write(out, lay, model, model in presets(), pr.seq, pr.global_batch, pr.bf16)
    log = os.path.join(out, "log")
    argv = [
        "-m",
        "dsnd",
        "train",
        "--config",
        os.path.join(out, emit.RUN_YAML),
        "--set",
        f"log.dir={log}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "log.tensorboard=false",
        "--set",
        "checkpoint.resume=never",
        "--set",
        "checkpoint.at_end=false",  # a measurement: no end-of-run save
        "--set",
        f"dist.backend={BACKENDS[accelerator]}",
        *(f"--set={item}" for item in sets),
    ]
    run_ranks(pr.world, argv, TIMEOUT_S, accelerator=accelerator)
    with open(os.path.join(log, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def median_step(rows: list[dict[str, Any]], key: str = "step_time_s") -> float:
    """The median of `key` over the steps after the first `WARM_STEPS`."""
    values = [r[key] for r in rows[WARM_STEPS:]] or [rows[-1][key]]
    return statistics.median(values)


def measure(model: str, pr: Problem, lay: Layout, steps: int, tmp: str) -> dict[str, float]:
    """Run the layout; its measured bytes (busiest stage) and seconds per step."""
    rows = run_layout(model, pr, lay, steps, tmp)
    last = rows[-1]
    stages = {k.split("_")[1] for k in last if k.startswith("memory_stage")}
    memory = max(
        last[f"memory_{s}_live_bytes"] + last[f"memory_{s}_activation_peak_bytes"] for s in stages
    )
    return {"memory_bytes": memory, "step_time_s": median_step(rows)}


def validate(model: str, pr: Problem, layouts: list[Layout], steps: int) -> list[dict[str, Any]]:
    """Predicted ÷ measured per layout, the efficiency calibrated on the first."""
    if steps <= WARM_STEPS:
        raise ValueError(f"--steps must be more than {WARM_STEPS} to time a step")
    with tempfile.TemporaryDirectory(prefix="dsnd-validate-") as tmp:
        measured = [measure(model, pr, lay, steps, tmp) for lay in layouts]
    if not measured:
        return []
    # every rate of the time model runs at the efficiency: time scales as 1 / efficiency
    one = replace(pr.device, efficiency=Efficiency.uniform(1.0))
    unit = replace(pr, device=one, measured=layer_costs(model, pr, layouts))
    at_one = [evaluate(unit, replace(lay), _split(pr, lay)).step_time_s for lay in layouts]
    efficiency = at_one[0] / measured[0]["step_time_s"]
    rows = []
    for lay, got, t1 in zip(layouts, measured, at_one, strict=True):
        states = resident_bytes(lay)
        predicted_s = t1 / efficiency
        rows.append(
            {
                "layout": lay.key(),
                **{
                    k: getattr(lay, k)
                    for k in (
                        "pp",
                        "tp",
                        "dp",
                        "cp",
                        "zero_stage",
                        "micro_batch",
                        "activation_checkpointing",
                        "schedule",
                    )
                },
                "predicted_memory_bytes": states,
                "measured_memory_bytes": got["memory_bytes"],
                "memory_ratio": states / got["memory_bytes"],
                "predicted_time_s": predicted_s,
                "measured_time_s": got["step_time_s"],
                "time_ratio": predicted_s / got["step_time_s"],
                "efficiency": efficiency,
            }
        )
    return rows


def layer_costs(model: str, pr: Problem, layouts: list[Layout]) -> dict[int, tuple[float, ...]]:
    """Each layer's forward + backward seconds at each micro-batch size the layouts use, measured
    in this process on one thread like a rank (a CPU has no datasheet to predict them from)."""
    import torch

    from dsnd.model.source import load_model
    from dsnd.plan.profile import measure_layers

    spec = load_model(model, "--model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            mb: tuple(c.seconds for c in measure_layers(spec, pr.seq, mb))
            for mb in sorted({lay.micro_batch for lay in layouts})
        }
    finally:
        torch.set_num_threads(threads)


def resident_bytes(lay: Layout) -> float:
    """The predicted bytes still held at a step's end (see the module docstring)."""
    kept = {"params", "optimizer", "activations"} | ({"grads"} if lay.zero_stage == 3 else set())
    return sum(v for k, v in lay.memory_bytes.items() if k in kept)


def _split(pr: Problem, lay: Layout) -> list[list[int]]:
    return pr.split(lay.pp, lay.virtual_stages)
