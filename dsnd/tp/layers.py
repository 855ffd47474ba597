"""Megatron-style tensor-parallel layers; the tensor-parallel group is a constructor argument.

A block is ``RowParallelLinear(act(ColumnParallelLinear(x)))``: the column layer holds a slice of
the output features (weight rows), the row layer the matching slice of its input features
(weight columns), so the activation between them never leaves its rank. One f (copy_to_tp) enters
the block and one g (reduce_from_tp) leaves it; with sequence parallelism they become an
all-gather and a reduce-scatter along the sequence (see dsnd/tp/mappings.py).

Split parameters carry ``tensor_model_parallel = True`` (DeepSpeed's
``is_model_parallel_parameter`` reads it), ``partition_dim``, ``partition_stride`` and
``tp_shard``, the `dsnd.tp.shard.Shard` saying which part of the full tensor the rank holds.
Replicated parameters whose gradient is only partial on each rank (under sequence parallelism,
the row layer's bias; inside a region, per-head norms) carry ``partial_grad = True``:
`allreduce_partial_grads` sums those over the group after backward, as Megatron does when it
finalises gradients.

Every layer's `load_full` takes the unsplit weight and keeps this rank's slice, so the full
model is the same whatever the tensor-parallel size. Linear layers take `transposed=True` for
`transformers`' Conv1D layout (GPT-2): weight ``(in, out)``, so names and full shapes match HF.
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
from dsnd.tp.shard import Shard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "allreduce_partial_grads",
    "divide",
    "enter_tp",
    "leave_tp",
    "load_full",
    "mark_split",
]


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def mark_split(param: nn.Parameter, shard: Shard) -> None:
    """Mark `param` as this rank's `shard` of a full tensor (for DeepSpeed and for dsnd)."""
    param.tensor_model_parallel = True  # DeepSpeed's is_model_parallel_parameter reads it
    param.partition_dim = shard.dim
    param.partition_stride = shard.stride
    param.tp_shard = shard


def _shard(group: dist.ProcessGroup, dim: int, full_len: int, stride: int = 1) -> Shard:
    return Shard(dim, dist.get_rank(group), dist.get_world_size(group), full_len, stride)


def _uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default distribution, with the fan-in of the full (unsplit) layer
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(tensor, -bound, bound)


def _copy(param: nn.Parameter, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ValueError(f"slice of shape {tuple(value.shape)} for a {tuple(param.shape)} param")
    with torch.no_grad():
        param.copy_(value)


def load_full(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `param` (all of it when `param` is not split)."""
    shard = getattr(param, "tp_shard", None)
    _copy(param, shard.take(full) if shard is not None else full)


def enter_tp(
    x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool, sequence_dim: int = 1
) -> torch.Tensor:
    """Enter a tensor-parallel region: f (copy_to_tp), or with sequence parallelism the
    all-gather of the sequence slices. Call once per input shared by several split layers."""
    if sequence_parallel:
        return gather_from_sp(x, group, sequence_dim)
    return copy_to_tp(x, group)


def leave_tp(
    x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool, sequence_dim: int = 1
) -> torch.Tensor:
    """Leave a tensor-parallel region: g (all-reduce of the partial sums), or with sequence
    parallelism their reduce-scatter along the sequence."""
    if sequence_parallel:
        return reduce_scatter_to_sp(x, group, sequence_dim)
    return reduce_from_tp(x, group)


class _ParallelLinear(nn.Module):
    """Weight ``(out_f, in_f)`` as nn.Linear, or ``(in_f, out_f)`` with `transposed` as
    `transformers`' Conv1D (GPT-2), so parameter names and full shapes stay those of the
    single-process model."""

    def __init__(self, in_f: int, out_f: int, transposed: bool) -> None:
        super().__init__()
        self.in_f, self.out_f, self.transposed = in_f, out_f, transposed

    def _dim(self, linear_dim: int) -> int:
        """The weight dimension of nn.Linear's `linear_dim` (0 = out, 1 = in) in this layout."""
        return 1 - linear_dim if self.transposed else linear_dim

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's part of the full weight (and bias) in this layer's layout."""
        load_full(self.weight, weight)
        if self.bias is not None and bias is not None:
            load_full(self.bias, bias)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with A split by rows (output features): rank i computes ``y_i``.

    Input: full (replicated) x, or with `sequence_parallel` this rank's slice of x along
    `sequence_dim`; with `enter=False` the caller has already applied `enter_tp` (one entry for
    several layers reading the same input, as Llama's q, k, v). Output: this rank's
    ``out_f / tp`` features, or all of them with `gather_output`. `stride` k > 1 splits each of
    k equal output parts (a fused q|k|v) separately, see `dsnd.tp.shard`.
    """

    def __init__(
        self,
        in_f: int,
        out_f: int,
        group: dist.ProcessGroup,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        transposed: bool = False,
        stride: int = 1,
        enter: bool = True,
    ) -> None:
        super().__init__(in_f, out_f, transposed)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel exclude each other")
        self.group = group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sequence_dim, self.enter = sequence_dim, enter
        local = divide(out_f, dist.get_world_size(group), "out_features")
        self.weight = nn.Parameter(torch.empty((in_f, local) if transposed else (local, in_f)))
        _uniform_(self.weight, in_f)
        mark_split(self.weight, _shard(group, self._dim(0), out_f, stride))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        if self.bias is not None:
            _uniform_(self.bias, in_f)
            mark_split(self.bias, _shard(group, 0, out_f, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = enter_tp(x, self.group, self.sequence_parallel, self.sequence_dim)
        y = self._matmul(x, self.bias)
        return gather_from_tp(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in_f={self.in_f}, out_f={self.out_f} (local {self.weight.tp_shard.local_len})"


class RowParallelLinear(_ParallelLinear):
    """``y = sum_i x_i A_i^T + b`` with A split by columns (input features).

    Input: this rank's ``in_f / tp`` features (`input_is_parallel`), else the full x, which is
    split here. Output: the full y on every rank, or with `sequence_parallel` this rank's slice
    along `sequence_dim` (reduce-scatter instead of all-reduce). The bias is replicated and
    added after the reduction, once.
    """

    def __init__(
        self,
        in_f: int,
        out_f: int,
        group: dist.ProcessGroup,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        transposed: bool = False,
    ) -> None:
        super().__init__(in_f, out_f, transposed)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel")
        self.group = group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim = sequence_dim
        local = divide(in_f, dist.get_world_size(group), "in_features")
        self.weight = nn.Parameter(torch.empty((local, out_f) if transposed else (out_f, local)))
        _uniform_(self.weight, in_f)
        mark_split(self.weight, _shard(group, self._dim(1), in_f))
        self.bias = nn.Parameter(torch.empty(out_f)) if bias else None
        if self.bias is not None:
            _uniform_(self.bias, in_f)
            # each rank sees only its sequence slice, so its bias gradient is a partial sum
            self.bias.partial_grad = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        y = leave_tp(self._matmul(x, None), self.group, self.sequence_parallel, self.sequence_dim)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_f={self.in_f} (local {self.weight.tp_shard.local_len}), out_f={self.out_f}"


class _VocabRows(nn.Module):
    """A ``(vocab, hidden)`` weight split by rows: the vocabulary is padded up to a multiple of
    tp and rank i holds the contiguous rows ``[i * v, (i + 1) * v)``, ``v = padded / tp``;
    padded rows are zero."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
        sequence_dim: int,
    ) -> None:
        super().__init__()
        shard = _shard(group, 0, vocab)
        self.group = group
        self.vocab, self.hidden = vocab, hidden
        self.padded_vocab, self.local_vocab = shard.padded_len, shard.local_len
        self.vocab_start = shard.rank * shard.local_len
        self.vocab_end = self.vocab_start + self.local_vocab
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden))
        nn.init.normal_(self.weight)
        mark_split(self.weight, shard)
        with torch.no_grad():
            self.weight[max(0, vocab - self.vocab_start) :].zero_()  # padded rows

    def load_full(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the full ``(vocab, hidden)`` weight (padding rows zero)."""
        if weight.shape != (self.vocab, self.hidden):
            raise ValueError(f"full weight {tuple(weight.shape)} != {(self.vocab, self.hidden)}")
        load_full(self.weight, weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``hidden @ weight.T`` (padded columns included; the
        vocab-parallel loss leaves them out). Sequence-parallel input is gathered first."""
        x = enter_tp(hidden, self.group, self.sequence_parallel, self.sequence_dim)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.vocab} (padded {self.padded_vocab}), hidden={self.hidden}, "
            f"rows [{self.vocab_start}, {self.vocab_end})"
        )


class VocabParallelEmbedding(_VocabRows):
    """An embedding whose rows (the vocabulary) are split over the group.

    Ids outside this rank's rows look up row 0 and are then zeroed, so the all-reduce (g) sums
    exactly one non-zero row per id. With `sequence_parallel` the sum is a reduce-scatter along
    `sequence_dim` instead. `logits` is the tied output head on the same weight.
    """

    def __init__(
        self,
        vocab: int,
        hidden: int,
        group: dist.ProcessGroup,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> None:
        super().__init__(vocab, hidden, group, sequence_parallel, sequence_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(rows, self.group, self.sequence_parallel, self.sequence_dim)


class VocabParallelHead(_VocabRows):
    """An untied output projection hidden -> logits, split by vocabulary rows like the
    embedding (a separate class so optimizers treat it as a matrix, not an embedding).
    Output: this rank's ``padded_vocab / tp`` logits, for `vocab_parallel_cross_entropy`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)


def allreduce_partial_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum, over the group, the gradients of replicated parameters marked ``partial_grad``.

    Under sequence parallelism a replicated parameter (the row layer's bias, norms) sees only
    this rank's tokens; inside a split region one (a per-head q/k norm) sees only this rank's
    heads: either way its gradient is a partial sum; call this after backward
    and before the optimizer (or DeepSpeed's data-parallel reduction). One flat all-reduce.
    """
    grads = [p.grad for p in params if getattr(p, "partial_grad", False) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
