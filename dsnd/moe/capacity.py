"""An expert capacity for mixture-of-experts layers (`model.moe_capacity_factor`), with the
tokens it drops counted.

`transformers`' MoE families route dropless: every (token, choice) row reaches its expert.
With a capacity factor f each expert of a layer takes at most

    C = ceil(f * T * k / E)

rows of a forward of T tokens on this rank (k choices per token, E experts), the earliest
tokens first (Megatron's "position" drop policy); a dropped row's router weight becomes 0, so
it adds nothing to its token's output (the residual carries the token on) and gives its expert
and router no gradient. The capacity is a rank's own: with expert parallelism the rows are
dropped before they are sent, so a layout drops the rows one process drops on the same
micro-batches. A forward pre-hook on each layer's experts module (the plain `transformers` one
or `dsnd.moe.ParallelExperts`) rewrites the router weights it is called with; the weights'
dropped entries are counted per layer for telemetry (not again in a checkpoint's recompute).
Exports stay `transformers`' dropless model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsnd.model.checkpointing import in_recompute
from dsnd.moe import expert_counts, moe_experts


def keep_mask(top_k_index: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """(T, k) bool: which (token, choice) rows fit their expert's capacity, earliest token
    first (a token picks an expert at most once, so within an expert rows are tokens)."""
    tokens, k = top_k_index.shape
    capacity = math.ceil(factor * tokens * k / experts)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, then by token (row-major order)
    counts = expert_counts(flat, experts).to(flat.dtype)  # not bincount: no host sync
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (position < capacity).view(tokens, k)


class Capacity:
    """Capacity `factor` on every MoE layer of `stack` (a `LayerStack`); `dropped` counts the
    rows training forwards dropped per block number since the last `take()` (nothing where
    `counts` is False: a rank whose tokens another rank counts; nothing in an evaluation's
    forwards, which would land in the next step's count)."""

    def __init__(self, stack: nn.Module, factor: float, blocks: int, counts: bool = True) -> None:
        if factor <= 0:
            raise ValueError(f"a capacity factor must be > 0, got {factor}")
        self.factor, self.counts = factor, counts
        self.dropped = torch.zeros(blocks, dtype=torch.float64)
        self._handles = []
        for key, layer in stack.layers.items():
            experts = moe_experts(layer)
            if experts is not None:
                hook = self._hook(int(key) - 1)
                self._handles.append(experts.register_forward_pre_hook(hook))

    def _hook(self, block: int):
        def cap(module: nn.Module, args: tuple) -> tuple:
            hidden, index, weights = args
            keep = keep_mask(index, module.num_experts, self.factor)
            if self.counts and module.training and not in_recompute():  # not evaluations
                if self.dropped.device != keep.device:
                    self.dropped = self.dropped.to(keep.device)
                self.dropped[block] += (~keep).sum()
            return hidden, index, weights * keep.to(weights.dtype)

        return cap

    def take(self) -> torch.Tensor:
        """The dropped rows per block since the last call (this rank's), and start again."""
        out, self.dropped = self.dropped, torch.zeros_like(self.dropped)
        return out
