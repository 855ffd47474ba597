"""Language-model loss."""

from __future__ import annotations

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 over labels != -100.

    `labels[b, t]` is the target of `logits[b, t]` (already shifted by the data pipeline), so the
    signature fits DeepSpeed's `PipelineModule(loss_fn=...)`.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, vocab), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
