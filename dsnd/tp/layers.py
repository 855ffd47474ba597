"""Megatron-style tensor-parallel layers; the tensor-parallel group is a constructor argument.

A block is ``RowParallelLinear(act(ColumnParallelLinear(x)))``: the column layer holds a slice of
the output features (weight rows), the row layer the matching slice of its input features
(weight columns), so the activation between them never leaves its rank. One f (copy_to_tp) enters
the block and one g (reduce_from_tp) leaves it; with sequence parallelism they become an
all-gather and a reduce-scatter along the sequence (see dsnd/tp/mappings.py).

Split parameters carry ``tensor_model_parallel = True`` (DeepSpeed's
``is_model_parallel_parameter`` reads it), ``partition_dim`` and ``partition_stride``.
Replicated parameters whose gradient is only partial on each rank under sequence parallelism
(the row layer's bias) carry ``sequence_parallel = True``: `allreduce_sequence_parallel_grads`
sums those over the group after backward, as Megatron does when it finalises gradients.

Every layer's `load_full` takes the unsplit weight and keeps this rank's slice, so the full
model is the same whatever the tensor-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsnd.tp.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "divide",
]


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def _mark_split(param: nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def _uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default distribution, with the fan-in of the full (unsplit) layer
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(tensor, -bound, bound)


def _slice(full: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.chunk(world, dim)[rank] if world > 1 else full


def _copy(param: nn.Parameter, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ValueError(f"slice of shape {tuple(value.shape)} for a {tuple(param.shape)} param")
    with torch.no_grad():
        param.copy_(value)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by rows (output features): rank i computes ``y_i``.

    Input: full (replicated) x, or with `sequence_parallel` this rank's slice of x along
    `sequence_dim`. Output: this rank's ``out_f / tp`` features, or all of them with
    `gather_output`.
    """

    def __init__(self, in_f: int, out_f: int, group: dist.ProcessGroup, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1) -> None:  # fmt: skip
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel exclude each other")
        self.group = group
        self.in_f, self.out_f = in_f, out_f
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sequence_dim = sequence_dim
        local = divide(out_f, dist.get_world_size(group), "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_f))
        _uniform_(self.weight, in_f)
        _mark_split(self.weight, 0)
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        if self.bias is not None:
            _uniform_(self.bias, in_f)
            _mark_split(self.bias, 0)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's rows of the full ``(out_f, in_f)`` weight (and ``(out_f,)`` bias)."""
        _copy(self.weight, _slice(weight, 0, self.group))
        if self.bias is not None and bias is not None:
            _copy(self.bias, _slice(bias, 0, self.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sp(x, self.group, self.sequence_dim)
        else:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in_f={self.in_f}, out_f={self.out_f} (local {self.weight.shape[0]})"


class RowParallelLinear(nn.Module):
    """``y = sum_i x_i A_i^T + b`` with A split by columns (input features).

    Input: this rank's ``in_f / tp`` features (`input_is_parallel`), else the full x, which is
    split here. Output: the full y on every rank, or with `sequence_parallel` this rank's slice
    along `sequence_dim` (reduce-scatter instead of all-reduce). The bias is replicated and
    added after the reduction, once.
    """

    def __init__(self, in_f: int, out_f: int, group: dist.ProcessGroup, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1) -> None:  # fmt: skip
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel")
        self.group = group
        self.in_f, self.out_f = in_f, out_f
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim = sequence_dim
        local = divide(in_f, dist.get_world_size(group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_f, local))
        _uniform_(self.weight, in_f)
        _mark_split(self.weight, 1)
        self.bias = nn.Parameter(torch.empty(out_f)) if bias else None
        if self.bias is not None:
            _uniform_(self.bias, in_f)
            # each rank sees only its sequence slice, so its bias gradient is a partial sum
            self.bias.sequence_parallel = sequence_parallel

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's columns of the full ``(out_f, in_f)`` weight; the bias is whole."""
        _copy(self.weight, _slice(weight, 1, self.group))
        if self.bias is not None and bias is not None:
            _copy(self.bias, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_f={self.in_f} (local {self.weight.shape[1]}), out_f={self.out_f}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group.

    The vocabulary is padded up to a multiple of tp; rank i holds the contiguous rows
    ``[i * v, (i + 1) * v)`` with ``v = padded / tp``. Ids outside this rank's rows look up row 0
    and are then zeroed, so the all-reduce (g) sums exactly one non-zero row per id. With
    `sequence_parallel` the sum is a reduce-scatter along `sequence_dim` instead.
    """

    def __init__(self, vocab: int, hidden: int, group: dist.ProcessGroup,
                 sequence_parallel: bool = False, sequence_dim: int = 1) -> None:  # fmt: skip
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.vocab, self.hidden = vocab, hidden
        self.padded_vocab = -(-vocab // world) * world
        self.local_vocab = self.padded_vocab // world
        self.vocab_start = rank * self.local_vocab
        self.vocab_end = self.vocab_start + self.local_vocab
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden))
        nn.init.normal_(self.weight)
        _mark_split(self.weight, 0)
        with torch.no_grad():
            self.weight[max(0, vocab - self.vocab_start) :].zero_()  # padded rows

    def load_full(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the full ``(vocab, hidden)`` weight (padding rows zero)."""
        if weight.shape != (self.vocab, self.hidden):
            raise ValueError(f"full weight {tuple(weight.shape)} != {(self.vocab, self.hidden)}")
        padded = weight.new_zeros(self.padded_vocab, self.hidden)
        padded[: self.vocab] = weight
        _copy(self.weight, padded[self.vocab_start : self.vocab_end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(rows, self.group, self.sequence_dim)
        return reduce_from_tp(rows, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab} (padded {self.padded_vocab}), hidden={self.hidden}, "
                f"rows [{self.vocab_start}, {self.vocab_end})")  # fmt: skip


def allreduce_sequence_parallel_grads(
    params: Iterable[nn.Parameter], group: dist.ProcessGroup
) -> None:
    """Sum, over the group, the gradients of replicated parameters used on sequence slices.

    Under sequence parallelism a replicated parameter (the row layer's bias, later norms)
    sees only this rank's tokens, so its gradient is a partial sum; call this after backward
    and before the optimizer (or DeepSpeed's data-parallel reduction). One flat all-reduce.
    """
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]  # fmt: skip
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
