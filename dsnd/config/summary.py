"""The resolved run in two lines, as the start of a run and ``dsnd ds-config explain`` print
them: the batch arithmetic and the precision the DeepSpeed JSON turns on."""

from __future__ import annotations

from typing import Any

from dsnd.config.batch import Batch
from dsnd.topology import Topology


def batch_line(batch: Batch, t: Topology) -> str:
    context = f", cp={t.cp}: context-parallel ranks share their samples" if t.cp > 1 else ""
    return (
        f"batch: train_batch_size {batch.train} = micro {batch.micro} x "
        f"gradient_accumulation_steps {batch.gas} x dp {t.dp} (pp={t.pp}, tp={t.tp}"
        f"{context})"
    )


def precision(ds: dict[str, Any]) -> str:
    """The dtype the (filled) JSON's matmuls run in: "bf16" ("bf16" or its alias "bfloat16"
    enabled), "fp16" or "fp32" (DeepSpeed refuses both half precisions at once). MFU is taken
    against the device's peak in this dtype."""
    if any((ds.get(k) or {}).get("enabled") is True for k in ("bf16", "bfloat16")):
        return "bf16"
    return "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32"


def precision_line(ds: dict[str, Any]) -> str:
    """What the (filled) JSON trains in: bf16 or fp16 (with its loss scaling) or fp32."""
    kind = precision(ds)
    if kind == "bf16":
        return "precision: bf16 parameters and gradients, fp32 master weights"
    if kind == "fp16":
        fp16 = ds["fp16"]
        scale = fp16.get("loss_scale", 0)
        scaling = f"static loss scale {scale:g}" if scale else "dynamic loss scaling"
        return f"precision: fp16 parameters and gradients ({scaling}), fp32 master weights"
    return "precision: fp32"
