"""How many tokens each expert of each MoE layer received in a step: forward hooks on the
routers of one stage's blocks (`transformers`' top-k routers return (logits, weights, expert
ids)), counted in training forwards only, and not again when activation checkpointing recomputes
a block inside backward. Every rank counts its own tokens of its own layers; one sum over the
world (`gathered`) gives the whole step's load of every layer: each token counted top-k times
per MoE layer, as routing is dropless.

With expert parallelism (`dsnd.moe`) a hook on each layer's `ParallelExperts` also counts the
(token, choice) rows this rank sends to another rank of its expert-parallel group: the rows
its all-to-all dispatches (and the combine brings back), the traffic `parallel.ep` costs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsnd.model.checkpointing import in_recompute
from dsnd.model.moe_config import moe_router, num_experts
from dsnd.moe import ParallelExperts


def _counting(module: nn.Module) -> bool:
    """A training forward, not a checkpoint's recompute inside backward."""
    return module.training and not in_recompute()


class RouterLoad:
    """Per-expert token counts of the MoE layers of `stack` (a `LayerStack`), by block number
    (block b is global layer b + 1), over `blocks` blocks in the model. `counts` False: this
    rank's tokens are another's too (a tensor-parallel rank other than the first, without
    sequence parallelism, routes the same tokens as the first), so it counts nothing."""

    def __init__(self, stack: nn.Module, config, blocks: int, counts: bool = True) -> None:
        # per block: tokens per expert, then the rows sent to other expert-parallel ranks
        self.counts = torch.zeros(blocks, num_experts(config) + 1, dtype=torch.float64)
        self._handles = []
        for index, layer in stack.layers.items() if counts else ():
            router = moe_router(layer)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._hook(int(index) - 1)))
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(experts, ParallelExperts):
                self._handles.append(
                    experts.register_forward_hook(self._sent_hook(int(index) - 1), with_kwargs=True)
                )

    def _row(self, block: int, on: torch.Tensor) -> torch.Tensor:
        if self.counts.device != on.device:  # counted where routing runs: no sync
            self.counts = self.counts.to(on.device)
        return self.counts[block]

    def _hook(self, block: int):
        def count(module: nn.Module, _inputs, output) -> None:
            if _counting(module):
                ids = output[2].detach().reshape(-1)
                row = self._row(block, ids)
                row[:-1].index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))

        return count

    def _sent_hook(self, block: int):
        def count(module: ParallelExperts, args, kwargs, _output) -> None:
            if _counting(module):
                ids = (args[1] if len(args) > 1 else kwargs["top_k_index"]).detach()
                owner = ids // len(module.span)
                self._row(block, ids)[-1] += (owner != module.ep.rank).sum()

        return count

    def gathered(self, device: torch.device) -> tuple[list[list[float]], list[float]]:
        """Every MoE layer's counts this step, summed over the world (collective), by block
        number: tokens per expert, and rows sent to another expert-parallel rank (0 without
        expert parallelism); blocks without experts (dense ones, other families' layers) all
        zero. Resets the counts."""
        total = self.counts.to(device, copy=True)
        dist.all_reduce(total)
        self.counts.zero_()
        rows = total.cpu().tolist()
        return [r[:-1] for r in rows], [r[-1] for r in rows]
