"""A rank's tensor-parallel group and mode, handed to every tensor-parallel layer it builds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsnd.tp.layers import enter_tp, leave_tp


@dataclass(frozen=True)
class RankGroup:
    """A process group as one of its ranks sees it (also the base of `dsnd.cp`'s)."""

    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


@dataclass(frozen=True)
class TensorParallel(RankGroup):
    sequence_parallel: bool = False

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a split region: f, or the sequence all-gather (see dsnd.tp.layers.enter_tp)."""
        return enter_tp(x, self.group, self.sequence_parallel)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a split region: g, or the sequence reduce-scatter."""
        return leave_tp(x, self.group, self.sequence_parallel)

    def mark_replicated(self, module: nn.Module) -> None:
        """Under sequence parallelism every parameter of `module` that is not split works on
        this rank's sequence slice only (norms, position embeddings, row biases), so its gradient
        is a partial sum: mark it for `allreduce_partial_grads`."""
        for param in module.parameters():
            if not getattr(param, "tensor_model_parallel", False):
                param.partial_grad = self.sequence_parallel
