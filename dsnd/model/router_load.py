"""How many tokens each expert of each MoE layer received in a step: forward hooks on the
routers of one stage's blocks (`transformers`' top-k routers return (logits, weights, expert
ids)), counted in training forwards only, and not again when activation checkpointing recomputes
a block inside backward. Every rank counts its own tokens of its own layers; one sum over the
world (`gathered`) gives the whole step's load of every layer: each token counted top-k times
per MoE layer, as routing is dropless."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsnd.model.moe import num_experts


class RouterLoad:
    """Per-expert token counts of the MoE layers of `stack` (a `LayerStack`), by block number
    (block b is global layer b + 1), over `blocks` blocks in the model."""

    def __init__(self, stack: nn.Module, config, blocks: int) -> None:
        self.counts = torch.zeros(blocks, num_experts(config), dtype=torch.float64)
        self._handles = []
        for index, layer in stack.layers.items():
            router = getattr(getattr(layer, "mlp", None), "gate", None)
            if router is not None and hasattr(router, "top_k"):
                self._handles.append(router.register_forward_hook(self._hook(int(index) - 1)))

    def _hook(self, block: int):
        def count(module: nn.Module, _inputs, output) -> None:
            in_backward = torch._C._current_graph_task_id() != -1  # a checkpoint's recompute
            if module.training and not in_backward:
                ids = output[2].detach().reshape(-1)
                if self.counts.device != ids.device:  # counted where routing runs: no sync
                    self.counts = self.counts.to(ids.device)
                self.counts[block].index_add_(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))

        return count

    def gathered(self, device: torch.device) -> list[list[float]]:
        """Every MoE layer's counts this step, summed over the world (collective), by block
        number; blocks without experts (dense ones, other families' layers) all zero. Resets
        the counts."""
        total = self.counts.to(device, copy=True)
        dist.all_reduce(total)
        self.counts.zero_()
        return total.cpu().tolist()
