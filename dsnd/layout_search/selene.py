"""Published measurements the planner is checked against (pure data and the predictions).

Iteration times of Megatron-LM on Selene (DGX A100 80 GB, NVLink within 8-GPU nodes, HDR
InfiniBand between), Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models") Table 5, full recomputation against sequence parallelism with selective
recomputation; setups from its Table 3 (sequence 2048, vocabulary 51200, fp16; 175B and 530B on
the interleaved schedule with 3 chunks per stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsnd.layout_search.hardware import DEVICES, Device
from dsnd.layout_search.shape import ModelShape, gpt
from dsnd.layout_search.timing import Step, step_seconds, uniform_stages


@dataclass(frozen=True)
class Run:
    name: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    virtual: int
    full_s: float  # measured seconds per iteration, full recomputation
    selective_s: float  # with sequence parallelism and selective recomputation


RUNS = (
    Run("22B", 48, 6144, 64, 8, 1, 4, 4, 1, 1.42, 1.10),
    Run("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13, 13.75),
    Run("530B", 105, 20480, 128, 8, 35, 280, 1, 3, 49.05, 37.83),
    Run("1T", 128, 25600, 160, 8, 64, 512, 1, 1, 94.42, 71.49),
)
SEQ = 2048


def shape(run: Run) -> ModelShape:
    return gpt(run.name, run.layers, run.hidden, run.heads, seq=SEQ)


def step(run: Run, mode: str) -> Step:
    """`mode` "full" (tensor parallelism alone, every block recomputed) or "selective"
    (sequence parallelism, the attention core recomputed)."""
    m = run.global_batch // run.micro_batch
    schedule = "interleaved-1f1b" if run.virtual > 1 else "1f1b"
    return Step(
        run.pp,
        run.tp,
        1,
        1,
        0,
        run.micro_batch,
        m,
        SEQ,
        schedule,
        run.virtual,
        recompute=mode,
        sp=mode == "selective",
        bf16=True,
        scores_in_memory=True,
        scatter_gather=True,
    )


def predict(run: Run, mode: str, device: Device = DEVICES["a100"]) -> float:
    sh = shape(run)
    return step_seconds(sh, uniform_stages(sh, run.pp, run.virtual), step(run, mode), device)


def measured(run: Run, mode: str) -> float:
    return run.full_s if mode == "full" else run.selective_s
