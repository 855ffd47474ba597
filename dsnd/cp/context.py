"""A rank's context-parallel group and mode, handed to every layer that needs it: the embedding
and blocks (positions of this rank's slice), attention (through the group), the loss (a mean
over the whole sequence).

Attention reaches dsnd through transformers' own attention interface: blocks built for cp > 1
carry a config whose `_attn_implementation` is `ATTENTION` (registered here), and pass
``context_parallel=`` down with the other attention arguments.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig

from dsnd.cp.ring import ring_attention
from dsnd.cp.slices import slice_positions
from dsnd.cp.ulysses import ulysses_attention
from dsnd.tp.context import RankGroup

ATTENTION = "dsnd_context_parallel"


@dataclass(frozen=True)
class ContextParallel(RankGroup):
    impl: str = "ring"

    def positions(self, seq: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions (indices into a `seq`-token sequence) of this rank's slice."""
        return torch.tensor(
            slice_positions(seq, self.size, self.rank, self.impl), dtype=torch.long, device=device
        )

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a (batch, seq, ...) tensor of whole sequences."""
        return tensor.index_select(1, self.positions(tensor.shape[1], tensor.device))

    def attention(
        self, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        if self.impl == "ulysses":
            return ulysses_attention(module, q, k, v, self.group, **kwargs)
        scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
        return ring_attention(q, k, v, self.group, scale)


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context_parallel: ContextParallel,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; causal, no mask (as dsnd's SDPA path)."""
    if attention_mask is not None:
        raise ValueError("context-parallel attention is causal and takes no attention mask")
    if kwargs.get("dropout"):
        raise ValueError("context-parallel attention has no dropout")
    kwargs.pop("dropout", None)
    return context_parallel.attention(module, query, key, value, **kwargs), None


AttentionInterface.register(ATTENTION, _attention)


def attention_config(config: PretrainedConfig, cp: ContextParallel | None) -> PretrainedConfig:
    """`config` itself, or for cp > 1 a copy whose attention is `ATTENTION`."""
    if cp is None or cp.size == 1:
        return config
    config = copy.copy(config)
    config._attn_implementation = ATTENTION
    return config
