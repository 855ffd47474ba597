"""How many (token, choice) rows each expert of a layer got, without a host sync.

`torch.bincount` reads the largest id back to the host on the GPU (its output length depends
on the data) even when `minlength` is given: a device-to-host sync per MoE layer. A
`scatter_add_` of ones into E fixed slots counts the same on the device:

    counts[e] = sum_i [ids_i == e],   e in [0, E)
"""

from __future__ import annotations

import torch


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """(experts,) int64: how many of `ids` (any shape, values in [0, experts)) name each
    expert."""
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))
