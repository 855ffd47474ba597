"""The resolved run in two lines, as the start of a run and ``dsnd ds-config explain`` print
them: the batch arithmetic and the precision the DeepSpeed JSON turns on."""

from __future__ import annotations

from typing import Any

from dsnd.config.batch import Batch
from dsnd.topology import Topology


def batch_line(batch: Batch, t: Topology) -> str:
    context = f", cp={t.cp}: context-parallel ranks share their samples" if t.cp > 1 else ""
    return (f"batch: train_batch_size {batch.train} = micro {batch.micro} x "
            f"gradient_accumulation_steps {batch.gas} x dp {t.dp} (pp={t.pp}, tp={t.tp}"
            f"{context})")  # fmt: skip


def precision_line(ds: dict[str, Any]) -> str:
    """What the (filled) JSON trains in: bf16 or fp16 (with its loss scaling) or fp32."""
    bf16 = any((ds.get(k) or {}).get("enabled") is True for k in ("bf16", "bfloat16"))
    fp16 = ds.get("fp16") or {}
    if bf16:
        return "precision: bf16 parameters and gradients, fp32 master weights"
    if fp16.get("enabled") is True:
        scale = fp16.get("loss_scale", 0)
        scaling = f"static loss scale {scale:g}" if scale else "dynamic loss scaling"
        return f"precision: fp16 parameters and gradients ({scaling}), fp32 master weights"
    return "precision: fp32"
