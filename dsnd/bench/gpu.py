"""``dsnd bench gpu``: everything to measure when a GPU is lent, as one command (a budget of
8 minutes on one H200; no end-of-run checkpoints). Skipped (one line, exit 0) where torch sees
no CUDA device.

- GPT-2-medium in bf16 at ZeRO 0, 1 and 3, each with and without activation checkpointing:
  tokens/s, MFU, and the peak memory the allocator saw ÷ `dsnd plan`'s prediction.
- World-1 MFU in bf16 and in fp16 of GPT-2-medium and a Llama-3.2-1B-shaped preset at seq 2048
  (ZeRO-1), each against the product's dense peak in that precision (`dsnd.report.flops.PEAKS`).
- A ZeRO-1 step with the optimizer offloaded to the CPU (DeepSpeed's CPU Adam): tokens/s ÷ the
  same layout without offload.
- The MoE experts as one grouped matmul ÷ a per-expert loop (`dsnd bench moe`'s rows, on CUDA).
- Ring attention's block kernel and SDPA under the document-packing mask against the math path:
  equal within bf16's tolerance, and their time (`dsnd.bench.kernels`).

Each training configuration is a real ``dsnd train`` of one rank (DeepSpeed's CUDA accelerator
and engine, nccl), written by the planner's `emit` as ``dsnd plan --out`` would, for a few
steps; medians after two warm-up steps. MFU counts model FLOPs (6N + 12Lhs per token,
`dsnd.report.flops`) against the device's dense peak in the run's precision, the product matched
exactly (`dsnd.report.flops.DEVICE_NAMES`); peak memory is each step's own (the allocator's peak
statistics are reset as a step starts).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace

from dsnd.bench.rows import Row, Skipped, Target

MODEL = "gpt2-medium"
SEQ = 1024
MICRO_BATCH = 8
CONFIGS = [(zero, ac) for zero in (0, 1, 3) for ac in (False, True)]
MEMORY_TARGET = Target.between(0.85, 1.15)  # measured peak within 15% of the prediction
MFU_MODELS, MFU_SEQ, MFU_MICRO = ("gpt2-medium", "llama-3.2-1b"), 2048, 4
MFU_TARGET = Target.at_least(0.30)  # world 1, no compile: what a model this size should reach
PRECISIONS = {"bf16": (), "fp16": ("ds.bf16.enabled=false", "ds.fp16.enabled=true")}
OFFLOAD = ("ds.zero_optimization.offload_optimizer.device=cpu",)


def _device():
    import torch

    from dsnd.layout_search.hardware import DEVICES, named_device

    name = torch.cuda.get_device_name(0)
    found = named_device(name)
    if found is None:
        known = ", ".join(str(d.product) for d in DEVICES.values())
        raise ValueError(f"no planner datasheet for {name!r} (known: {known})")
    return found, name


def gpu(args: argparse.Namespace, tmp: str) -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        raise Skipped("torch sees no CUDA device")
    from dsnd.layout_search.search import Problem, plan
    from dsnd.layout_search.source import load
    from dsnd.layout_search.validate import median_step, run_layout

    device, name = _device()
    _, shape, split = load(MODEL)
    pr = Problem(shape, split, 1, device, SEQ, MICRO_BATCH, bf16=True)
    layouts = {
        (x.zero_stage, x.activation_checkpointing): x
        for x in plan(pr)
        if x.micro_batch == MICRO_BATCH
    }
    rows = []
    steps = max(args.steps, 3)
    rows += _mfu_rows(device, name, steps, tmp)
    rows += _offload_rows(device, name, steps, tmp)
    rows += _kernel_rows(args)
    for zero, ac in CONFIGS:
        lay = layouts[(zero, ac)]
        with tempfile.TemporaryDirectory(dir=tmp) as where:
            got = run_layout(MODEL, pr, lay, steps, where, accelerator="cuda")  # nccl
        tag = f"zero{zero}{'_ac' if ac else ''}"
        peak = max(
            v for k, v in got[-1].items() if k.endswith("_peak_bytes") and "activation" not in k
        )
        rows += [
            Row(
                f"{tag}_tokens_per_s",
                median_step(got, "tokens_per_s"),
                bench="gpu",
                note=f"{name}, {MODEL}, bf16, seq {SEQ}, micro-batch {MICRO_BATCH}",
            ),
            Row(
                f"{tag}_mfu",
                median_step(got, "mfu"),
                bench="gpu",
                note=f"plan predicted {lay.mfu:.3f}",
            ),
            Row(
                f"{tag}_peak_memory_ratio",
                peak / lay.total_bytes,
                MEMORY_TARGET,
                bench="gpu",
                note=f"measured {peak / 2**30:.2f} GiB / predicted "
                f"{lay.total_bytes / 2**30:.2f} GiB (torch.cuda.max_memory_allocated)",
            ),
        ]
    return rows


def _layout(model: str, device, seq: int, micro: int, zero: int):
    """The planner's world-1 layout of `model` at ZeRO `zero` without activation
    checkpointing, and its problem."""
    from dsnd.layout_search.search import Problem, plan
    from dsnd.layout_search.source import load

    _, shape, split = load(model)
    pr = Problem(shape, split, 1, device, seq, micro, bf16=True)
    for lay in plan(pr):
        if (lay.micro_batch, lay.zero_stage, lay.activation_checkpointing) == (micro, zero, False):
            return pr, lay
    raise ValueError(f"no ZeRO-{zero} world-1 layout of {model} at micro-batch {micro}")


def _mfu_rows(device, name: str, steps: int, tmp: str) -> list[Row]:
    from dsnd.layout_search.validate import median_step, run_layout

    rows = []
    for model in MFU_MODELS:
        pr, lay = _layout(model, device, MFU_SEQ, MFU_MICRO, 1)
        for precision, sets in PRECISIONS.items():
            with tempfile.TemporaryDirectory(dir=tmp) as where:
                got = run_layout(model, pr, lay, steps, where, sets, accelerator="cuda")
            rows.append(
                Row(
                    f"{model}_{precision}_mfu",
                    median_step(got, "mfu"),
                    MFU_TARGET,
                    f"{name}, world 1, ZeRO-1, seq {MFU_SEQ}, micro-batch {MFU_MICRO}, "
                    f"against the {precision} dense peak",
                    bench="gpu",
                )
            )
    return rows


def _offload_rows(device, name: str, steps: int, tmp: str) -> list[Row]:
    from dsnd.layout_search.validate import median_step, run_layout

    pr, lay = _layout(MODEL, device, SEQ, MICRO_BATCH, 1)
    speed = {}
    for label, sets in (("gpu", ()), ("cpu", OFFLOAD)):
        with tempfile.TemporaryDirectory(dir=tmp) as where:
            got = run_layout(MODEL, pr, lay, steps, where, sets, accelerator="cuda")
        speed[label] = median_step(got, "tokens_per_s")
    note = (
        f"{name}, {MODEL} bf16 ZeRO-1: optimizer on the CPU (DeepSpeed's CPU Adam) / on the "
        f"GPU, tokens/s {speed['cpu']:.0f} / {speed['gpu']:.0f}"
    )
    return [Row("zero1_offload_throughput_ratio", speed["cpu"] / speed["gpu"], None, note, "gpu")]


def _kernel_rows(args: argparse.Namespace) -> list[Row]:
    import torch

    from dsnd.bench.kernels import packing_rows, ring_kernel_rows
    from dsnd.bench.moe import grouped_rows

    cuda = torch.device("cuda")
    return [
        *ring_kernel_rows(cuda, torch.bfloat16, 10),
        *packing_rows(cuda, torch.bfloat16, 10),
        *(replace(row, bench="gpu") for row in grouped_rows(args)),
    ]
