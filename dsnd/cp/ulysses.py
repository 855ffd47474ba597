"""Ulysses attention: an all-to-all turns this rank's sequence slice of every head into the
whole sequence of a 1/cp share of the heads, attention runs locally on that, and a second
all-to-all turns the result back. DeepSpeed's own `deepspeed.sequence.layer.DistributedAttention`
does both exchanges (and their backward); dsnd only lays the tensors out as it expects
((batch, seq, heads, dim), batch first) and gives it transformers' SDPA attention as the local
one. Key/value heads are split over the group like query heads, so query head h still lands on
the rank that holds its key/value head (heads and key/value heads must divide by cp: checked
before start).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsnd.engine.public import distributed_attention


def ulysses_attention(
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal attention of (b, heads, s/cp, d) slices over the group's whole sequence;
    (b, s/cp, heads, d) as transformers' attention functions return it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def local(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        out, _ = sdpa_attention_forward(
            module, q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), None, **kwargs
        )
        return out  # (b, s, heads/cp, d)

    # scatter heads (dim 2), gather the sequence (dim 1); batch is dim 0
    attention = distributed_attention(local, group, scatter_idx=2, gather_idx=1)
    return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
