"""Published mixture-of-experts training runs the planner is checked against (pure data and the
predictions), both Megatron-Core on DGX H100 (80 GB, NVLink within 8-GPU nodes), dropless,
sequences of 4096, the interleaved 1F1B schedule and the distributed optimizer (ZeRO-1):

- Mixtral 8x7B: "468 TFLOPS for Mixtral 8X7B bf16 training" (Megatron-LM's
  megatron/core/transformer/moe/README.md, MCore v0.9), on its reference mapping in the same
  file (MCore v0.8): 64 GPUs, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch 256,
  all-to-all dispatcher, bf16.
- Qwen3-30B-A3B: Megatron-Bridge's docs/performance-summary.md, DGX-H100: 16 GPUs, global batch
  512, micro-batch 2, TP 1, PP 2, VP 24, EP 8; 10494 tokens/s per GPU (241 TFLOP/s) in the
  25.09 container (token-drop), 5275 tokens/s per GPU (121 TFLOP/s) in the 25.11 one
  (dropless with force-balanced routing, FP8 current scaling).

Each run's layout went through on 80 GB devices; whether the planner predicts that it fits is
part of the check (for dsnd's own blocks, which keep more activations than Megatron's fused MoE
layers).
Throughput is compared as step time: the planner's model FLOPs per token are its own (the
published TFLOP/s count attention differently), tokens per step are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsnd.layout_search.hardware import DEVICES
from dsnd.layout_search.search import Layout, Problem, evaluate
from dsnd.layout_search.source import load
from dsnd.layout_search.timing import uniform_stages


@dataclass(frozen=True)
class MoeRun:
    name: str
    preset: str
    world: int
    pp: int
    virtual: int
    ep: int
    micro_batch: int
    global_batch: int
    tokens_per_s_per_gpu: tuple[float, ...]  # as published, fastest first
    seq: int = 4096


RUNS = (
    MoeRun("Mixtral 8x7B", "mixtral-8x7b", 64, 4, 8, 8, 1, 256, (468e12 / 82.93e9,)),
    MoeRun("Qwen3-30B-A3B", "qwen3-30b-a3b", 16, 2, 24, 8, 2, 512, (10494.0, 5275.0)),
)
"""Mixtral's published figure is TFLOP/s; in tokens/s by the planner's own FLOPs per token
(82.93 GFLOP: `flops_per_token`), checked by a unit test."""


def layout(run: MoeRun) -> tuple[Problem, Layout]:
    """The run as a planner problem and its layout, evaluated (memory, step time)."""
    _, shape, _ = load(run.preset)
    dp = run.world // run.pp
    pr = Problem(
        shape,
        lambda pp, v: uniform_stages(shape, pp, v),
        run.world,
        DEVICES["h100"],
        run.seq,
        run.global_batch,
        bf16=True,
    )
    lay = Layout(
        run.pp,
        1,
        dp,
        1,
        1,
        run.micro_batch,
        False,
        "interleaved-1f1b",
        run.virtual,
        run.global_batch // (run.micro_batch * dp),
        ep=run.ep,
    )
    return pr, evaluate(pr, lay, uniform_stages(shape, run.pp, run.virtual))


def flops_per_token(run: MoeRun) -> float:
    """The planner's model FLOPs per token (forward and backward, a token's top-k experts)."""
    _, shape, _ = load(run.preset)
    return 3 * sum(shape.forward_flops(i, 1, run.seq) for i in range(len(shape.layer_params)))


def published_step_s(run: MoeRun) -> tuple[float, ...]:
    """Seconds per step the published throughputs come to."""
    tokens = run.global_batch * run.seq / run.world
    return tuple(tokens / rate for rate in run.tokens_per_s_per_gpu)
