"""Megatron's communication operators as autograd functions; every group is an argument.

Notation: a tensor-parallel group of ``t`` ranks; ``x_i`` is rank i's tensor, ``[x_0 | ... ]``
concatenation along ``dim``, ``dL/dy`` the gradient arriving in backward. Each operator's
backward is the adjoint (transpose) of its forward as a linear map:

    copy_to_tp         f:  y_i = x                   dL/dx = sum_i dL/dy_i      (all-reduce)
    reduce_from_tp     g:  y   = sum_i x_i           dL/dx_i = dL/dy            (identity)
    scatter_to_tp          y_i = split(x)_i          dL/dx = [dL/dy_0 | ...]    (all-gather)
    gather_from_tp         y   = [x_0 | ... ]        dL/dx_i = split(dL/dy)_i   (split)
    gather_from_sp         y   = [x_0 | ... ] (seq)  dL/dx_i = split_i(sum_j dL/dy_j)
                                                                      (reduce-scatter)
    reduce_scatter_to_sp   y_i = split_i(sum_j x_j)  dL/dx_i = [dL/dy_0 | ...] (all-gather)

f and g bracket a Megatron block (column-parallel then row-parallel linear): f before the column
layer, g after the row layer. Sequence parallelism replaces f by gather_from_sp and g by
reduce_scatter_to_sp, so activations outside the block stay split along the sequence and the
same bytes move as one all-gather plus one reduce-scatter instead of one all-reduce.

With a group of one rank every operator is the identity and no collective is issued.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_tp",
]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {world} ranks")
    return x.chunk(world, dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0: move `dim` there and back
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {world} ranks")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: y_i = x (identity forward); dL/dx = sum_i dL/dy_i (all-reduce backward)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: y = sum_i x_i (all-reduce forward); dL/dx_i = dL/dy (identity backward)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """y_i = split(x)_i along dim; dL/dx = all-gather of dL/dy_i along dim."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """y = all-gather of x_i along dim; dL/dx_i = split(dL/dy)_i (dL/dy is replicated)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    """y = all-gather of x_i along the sequence; each rank then computes its own partial use of
    y, so dL/dx_i = split_i(sum_j dL/dy_j) (reduce-scatter backward)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """y_i = split_i(sum_j x_j) along the sequence; dL/dx_j = all-gather of dL/dy_i."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of `dim` forward, all-gather backward."""
    return _ScatterToTP.apply(x, group, _dim(x, dim))


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward, keep this rank's slice backward."""
    return _GatherFromTP.apply(x, group, _dim(x, dim))


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence `dim` forward, reduce-scatter backward."""
    return _GatherFromSP.apply(x, group, _dim(x, dim))


def reduce_scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along the sequence `dim` forward, all-gather backward."""
    return _ReduceScatterToSP.apply(x, group, _dim(x, dim))
