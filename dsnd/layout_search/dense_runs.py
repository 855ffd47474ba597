"""Published dense training runs the planner's time model is fitted to and checked against (pure
data and the predictions), bf16 (Selene's: fp16) on A100 80 GB and H100 SXM 80 GB:

- "Llama 3 paper": Meta's Llama 3 405B pre-training, H100 SXM (700 W, 80 GB HBM3), TP 8, PP 16,
  CP 1 or 16, 16M tokens a step, its published BF16 MFU (43%, 41%; 38% at 128K context).
- "llm-foundry": MosaicML's MPT benchmark tables (H100 80 GB BF16, its >= 128 GPU table, A100
  80 GB), FSDP (FULL_SHARD: ZeRO-3; SHARD_GRAD_OP: ZeRO-2), whole-block activation
  checkpointing or none, published tokens/s per GPU. MPT is Megatron's GPT layer with a
  vocabulary of 50368 and learned positions: `gpt` reproduces every row's published parameter
  count to the parameter.
- "torchtitan A100": torchtitan's 64 x A100 80 GB FSDP table (tokens/s per GPU), the rows
  without selective checkpointing (the planner models whole-block checkpointing or none).
- "torchtitan H100 500 W": torchtitan's Llama 3.1 8B on 8 and 128 H100s with 96 GB HBM2e
  (2.4 TB/s) at a 500 W power limit, selective checkpointing: compared, not fitted (the planner's
  h100 is the 700 W SXM part; the runs' own peak is unpublished).
- "Korthikanti Table 5": Megatron on Selene (`dsnd.layout_search.selene`), measured iteration times.

Each run is predicted as published: its parallel degrees, ZeRO stage, micro-batch, accumulation
and recomputation. Where the publication leaves a knob out the choice is the note's. A run's
`published_s` is its step time: tokens/s per GPU and MFU converted with the planner's own FLOPs
per token (MFU publications may count attention differently: at 8K tokens a 405B step's
attention is 8% of its FLOPs, so up to 4% apart).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dsnd.layout_search import foundry_tables, selene
from dsnd.layout_search.hardware import DEVICES, Device, Efficiency
from dsnd.layout_search.shape import ModelShape, gpt, llama
from dsnd.layout_search.timing import Step, StepCost, step_cost, uniform_stages

MPT = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
"""llm-foundry's MPT sizes: (layers, hidden, heads)."""

LLAMA = {
    "llama-3.1-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256),
    "llama-3.1-405b": (126, 16384, 128, 8, 53248, 128256),
    "llama-2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama-2-70b": (80, 8192, 64, 8, 28672, 32000),
}
"""(layers, hidden, heads, kv heads, ffn, vocab), from the models' published configs."""


@dataclass(frozen=True)
class DenseRun:
    source: str
    model: str  # an `MPT` or `LLAMA` key, or a Selene run's name
    device: str  # the `DEVICES` entry it ran on
    world: int
    micro_batch: int
    accumulation: int  # micro-batches per step
    seq: int
    published: float
    unit: str  # "tokens/s/GPU", "MFU" or "s/step"
    recompute: str = "none"  # none | full | selective
    zero: int = 3
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual: int = 1
    fitted: bool = True
    note: str = ""

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    def label(self) -> str:
        ac = {"none": "", "full": ", ckpt", "selective": ", selective"}[self.recompute]
        par = "".join(
            f" {k}{v}"
            for k, v in (("TP", self.tp), ("PP", self.pp), ("VP", self.virtual), ("CP", self.cp))
            if v > 1
        )
        return (
            f"{self.source}: {self.model}, {self.world} {self.device},{par} ZeRO-{self.zero}, "
            f"seq {self.seq}, mb {self.micro_batch} x {self.accumulation}{ac}"
        )


def _llm_foundry(device: str, rows: str) -> tuple[DenseRun, ...]:
    """One table: "model seq gpus micro-batch accumulation checkpointing tokens/s/GPU [zero]"."""
    out = []
    for line in rows.strip().splitlines():
        model, seq, gpus, mb, acc, ac, tps, *zero = line.split()
        out.append(
            DenseRun(
                "llm-foundry",
                f"mpt-{model}",
                device,
                int(gpus),
                int(mb),
                int(acc),
                int(seq),
                float(tps),
                "tokens/s/GPU",
                "full" if ac == "y" else "none",
                int(zero[0]) if zero else 3,
            )
        )
    return tuple(out)


FOUNDRY_H100 = _llm_foundry("h100", foundry_tables.H100)
"""llm-foundry's H100 80GB BF16 tables (its >= 128 GPU one first; "2": SHARD_GRAD_OP)."""

FOUNDRY_A100 = _llm_foundry("a100", foundry_tables.A100)
"""llm-foundry's A100 80GB table (1600 Gbps RoCE between nodes; its two 70b rows pure bf16)."""

SELENE = "Korthikanti Table 5"
LLAMA3_NOTE = (
    "schedule and recomputation unpublished: taken as interleaved 1F1B with 8 chunks a "
    "rank (one layer each; the paper takes a layer off the first and last stages) and "
    "none"
)

OTHERS = (
    DenseRun(
        "Llama 3 paper",
        "llama-3.1-405b",
        "h100",
        8192,
        1,
        32,
        8192,
        0.43,
        "MFU",
        zero=1,
        tp=8,
        pp=16,
        virtual=8,
        note=LLAMA3_NOTE,
    ),
    DenseRun(
        "Llama 3 paper",
        "llama-3.1-405b",
        "h100",
        16384,
        1,
        16,
        8192,
        0.41,
        "MFU",
        zero=1,
        tp=8,
        pp=16,
        virtual=8,
        note=LLAMA3_NOTE,
    ),
    DenseRun(
        "Llama 3 paper",
        "llama-3.1-405b",
        "h100",
        16384,
        1,
        16,
        131072,
        0.38,
        "MFU",
        zero=1,
        tp=8,
        pp=16,
        cp=16,
        virtual=8,
        fitted=False,
        note="not fitted: at 128K attention is 57% of the planner's FLOPs, so how the paper "
        "counts it (causal or not) moves the step time by up to 1.4x",
    ),
    DenseRun("torchtitan A100", "llama-3-70b", "a100", 64, 1, 1, 8192, 331, "tokens/s/GPU", "full"),
    DenseRun("torchtitan A100", "llama-2-13b", "a100", 64, 2, 1, 4096, 2162, "tokens/s/GPU"),
    DenseRun("torchtitan A100", "llama-2-70b", "a100", 64, 2, 1, 4096, 353, "tokens/s/GPU", "full"),
    DenseRun(
        "torchtitan H100 500 W",
        "llama-3.1-8b",
        "h100",
        8,
        2,
        1,
        8192,
        5762,
        "tokens/s/GPU",
        fitted=False,
        note="not fitted: 500 W HBM2e H100s (peak unpublished); selective checkpointing "
        "predicted as none",
    ),
    DenseRun(
        "torchtitan H100 500 W",
        "llama-3.1-8b",
        "h100",
        128,
        2,
        1,
        8192,
        5605,
        "tokens/s/GPU",
        fitted=False,
        note="as above",
    ),
    *(
        DenseRun(
            SELENE,
            r.name,
            "a100",
            r.tp * r.pp,
            r.micro_batch,
            r.global_batch // r.micro_batch,
            selene.SEQ,
            seconds,
            "s/step",
            mode,
            zero=0,
            tp=r.tp,
            pp=r.pp,
            virtual=r.virtual,
        )
        for r in selene.RUNS
        for mode, seconds in (("full", r.full_s), ("selective", r.selective_s))
    ),
)

RUNS = FOUNDRY_H100 + FOUNDRY_A100 + OTHERS


@functools.cache
def shape(model: str, seq: int) -> ModelShape:
    if model.startswith("mpt-"):
        layers, hidden, heads = MPT[model[4:]]
        return gpt(model, layers, hidden, heads, vocab=50368, seq=seq)
    if model in LLAMA:
        return llama(model, *LLAMA[model], seq=seq)
    return selene.shape(next(r for r in selene.RUNS if r.name == model))


def stages(run: DenseRun) -> list[list[int]]:
    """Each stage's layers: the embedding and the head as one slot each beside the blocks,
    every chunk the same number of slots (Megatron's split where the blocks divide evenly)."""
    sh = shape(run.model, run.seq)
    chunks = run.pp * run.virtual
    if len(sh.blocks) % chunks == 0:
        return uniform_stages(sh, run.pp, run.virtual)
    first, last = sh.blocks[0], sh.blocks[-1]
    slots = [
        list(range(first)),
        *([b] for b in sh.blocks),
        list(range(last + 1, len(sh.layer_params))),
    ]
    per = len(slots) // chunks
    chunk = [sum(slots[c * per : (c + 1) * per], []) for c in range(chunks)]
    return [sum((chunk[c] for c in range(s, chunks, run.pp)), []) for s in range(run.pp)]


def step(run: DenseRun) -> Step:
    megatron = run.source == SELENE  # fp16 (bytes as bf16), scores in memory, SP when selective
    schedule = "interleaved-1f1b" if run.virtual > 1 else "1f1b"
    return Step(
        run.pp,
        run.tp,
        run.dp,
        run.cp,
        run.zero,
        run.micro_batch,
        run.accumulation,
        run.seq,
        schedule,
        run.virtual,
        run.recompute,
        sp=run.tp > 1 and (not megatron or run.recompute == "selective"),
        scores_in_memory=megatron,
        scatter_gather=megatron,
    )


@functools.cache
def cost(run: DenseRun) -> StepCost:
    return step_cost(shape(run.model, run.seq), stages(run), step(run), DEVICES[run.device])


def flops_per_token(run: DenseRun) -> float:
    """The planner's model FLOPs per token (forward and backward, no recomputation)."""
    sh = shape(run.model, run.seq)
    return 3 * sum(sh.forward_flops(i, 1, run.seq) for i in range(len(sh.layer_params)))


def _peak(run: DenseRun) -> float:
    return DEVICES[run.device].bf16_flops


def published_s(run: DenseRun) -> float:
    """The published figure as seconds per step."""
    tokens = run.global_batch * run.seq
    if run.unit == "s/step":
        return run.published
    if run.unit == "MFU":
        return tokens * flops_per_token(run) / (run.world * _peak(run) * run.published)
    return tokens / (run.world * run.published)


def mfu(run: DenseRun, seconds: float) -> float:
    """A step time of `run` as MFU (the planner's FLOPs, the device's dense bf16 peak)."""
    return run.global_batch * run.seq * flops_per_token(run) / (seconds * run.world * _peak(run))


def predicted_s(
    run: DenseRun, efficiency: Efficiency | None = None, device: Device | None = None
) -> float:
    """The planner's step time for the run at `efficiency` (default: its device's)."""
    dev = device or DEVICES[run.device]
    return cost(run).seconds(efficiency or dev.efficiency)
