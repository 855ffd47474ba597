"""``dsnd bench gpu``: one GPU, a GPT-2-medium-sized model in bf16 at ZeRO 0, 1 and 3, with and
without activation checkpointing: tokens/s, MFU against the device's peak and the peak memory
the allocator saw ÷ `dsnd plan`'s prediction for the same layout. Skipped (one line, exit 0)
where torch sees no CUDA device: this is the check to run whenever a GPU is lent.

Each configuration is a real ``dsnd train`` of one rank (DeepSpeed's CUDA accelerator and
engine, nccl; not the CPU accelerator dsnd's other benches pin), written by
the planner's `emit` as ``dsnd plan --out`` would, for a few steps; medians after two warm-up
steps. MFU counts model FLOPs (6N + 12Lhs per token, `dsnd.flops`) against the device's dense
bf16 peak, the product matched exactly (`dsnd.flops.DEVICE_NAMES`); peak memory is each step's
own (the allocator's peak statistics are reset as a step starts).
"""

from __future__ import annotations

import argparse
import tempfile

from dsnd.bench.rows import Row, Skipped, Target

MODEL = "gpt2-medium"
SEQ = 1024
MICRO_BATCH = 8
CONFIGS = [(zero, ac) for zero in (0, 1, 3) for ac in (False, True)]
MEMORY_TARGET = Target.between(0.85, 1.15)  # measured peak within 15% of the prediction


def _device():
    import torch

    from dsnd.layouts.hardware import DEVICES, named_device

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
    from dsnd.layouts.search import Problem, plan
    from dsnd.layouts.source import load
    from dsnd.layouts.validate import median_step, run_layout

    device, name = _device()
    _, shape, split = load(MODEL)
    pr = Problem(shape, split, 1, device, SEQ, MICRO_BATCH, bf16=True)
    layouts = {(x.zero_stage, x.activation_checkpointing): x for x in plan(pr)
               if x.micro_batch == MICRO_BATCH}  # fmt: skip
    rows = []
    steps = max(args.steps, 3)
    for zero, ac in CONFIGS:
        lay = layouts[(zero, ac)]
        with tempfile.TemporaryDirectory(dir=tmp) as where:
            got = run_layout(MODEL, pr, lay, steps, where, accelerator="cuda")  # nccl
        tag = f"zero{zero}{'_ac' if ac else ''}"
        peak = max(v for k, v in got[-1].items() if k.endswith("_peak_bytes")
                   and "activation" not in k)  # fmt: skip
        rows += [
            Row(f"{tag}_tokens_per_s", median_step(got, "tokens_per_s"), bench="gpu",
                note=f"{name}, {MODEL}, bf16, seq {SEQ}, micro-batch {MICRO_BATCH}"),
            Row(f"{tag}_mfu", median_step(got, "mfu"), bench="gpu",
                note=f"plan predicted {lay.mfu:.3f}"),
            Row(f"{tag}_peak_memory_ratio", peak / lay.total_bytes, MEMORY_TARGET, bench="gpu",
                note=f"measured {peak / 2**30:.2f} GiB / predicted "
                f"{lay.total_bytes / 2**30:.2f} GiB (torch.cuda.max_memory_allocated)"),
        ]  # fmt: skip
    return rows
