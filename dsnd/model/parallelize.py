"""Apply a family's `TPPlan` to a block built from the FULL config, and give meta tensors memory.

Blocks are built on the meta device (no memory), from the full config, so the module tree,
names and full shapes are exactly those of `transformers`. `parallelize` then swaps each column
and row layer for `dsnd.tp`'s Column/RowParallelLinear holding this rank's shard (same
parameter names, full shapes recorded in ``tp_shard``), divides the attributes that count local
heads, and hooks f onto the input of each region. `materialize` replaces every meta parameter
by real memory of the same (local) shape, so no rank ever allocates a full layer it does not
keep. Values come later (`dsnd.model.stack.init_layer`, or a checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from dsnd.model.family import TPPlan
from dsnd.tp import ColumnParallelLinear, RowParallelLinear
from dsnd.tp.context import TensorParallel
from dsnd.tp.layers import divide


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(the submodule holding `path`'s last part, that part): "attn.c_attn" -> (attn, "c_attn")."""
    owner, _, leaf = path.rpartition(".")
    return root.get_submodule(owner), leaf


def _features(linear: nn.Module) -> tuple[int, int, bool, bool]:
    """(in, out, transposed, has bias) of an nn.Linear or a Conv1D (weight (in, out))."""
    if isinstance(linear, nn.Linear):
        return linear.in_features, linear.out_features, False, linear.bias is not None
    if isinstance(linear, Conv1D):
        return linear.weight.shape[0], linear.nf, True, linear.bias is not None
    raise TypeError(f"cannot split a {type(linear).__name__}: only nn.Linear and Conv1D")


def _entry_hook(tp: TensorParallel):
    """A forward pre-hook applying f (or the sequence all-gather) to the module's first input,
    whether the block passes it by position or as ``hidden_states=``."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (tp.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp.enter(kwargs["hidden_states"])}

    return hook


def parallelize(block: nn.Module, plan: TPPlan, tp: TensorParallel) -> None:
    """Split `block` (built from the full config, on any device) over `tp` as `plan` says."""
    sp = tp.sequence_parallel
    for path, stride in plan.column.items():
        parent, leaf = _parent(block, path)
        in_f, out_f, transposed, bias = _features(getattr(parent, leaf))
        setattr(
            parent,
            leaf,
            ColumnParallelLinear(
                in_f, out_f, tp.group, bias=bias, transposed=transposed, stride=stride, enter=False
            ),
        )
    for path in plan.row:
        parent, leaf = _parent(block, path)
        in_f, out_f, transposed, bias = _features(getattr(parent, leaf))
        setattr(
            parent,
            leaf,
            RowParallelLinear(
                in_f, out_f, tp.group, bias=bias, sequence_parallel=sp, transposed=transposed
            ),
        )
    for path in plan.divide:
        parent, leaf = _parent(block, path)
        setattr(parent, leaf, divide(getattr(parent, leaf), tp.size, path))
    inside: set[int] = set()
    for path in plan.enter:
        region = block.get_submodule(path)
        region.register_forward_pre_hook(_entry_hook(tp), with_kwargs=True)
        inside |= {id(p) for p in region.parameters()}
    # a row layer's bias is added after g, so it is outside the region like a norm
    inside -= {id(block.get_submodule(path).bias) for path in plan.row}
    for param in block.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            param.partial_grad = sp or id(param) in inside


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device | str = "cpu") -> None:
    """Give every meta parameter of `module` real (uninitialised) memory on `device`, keeping
    its shape, dtype, ``requires_grad`` and tensor-parallel attributes. A buffer left on the
    meta device is an error: a layer must build its buffers (rotary frequencies) on a real one."""
    for mod_name, mod in module.named_modules():
        for name, param in list(mod.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            real = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device),
                requires_grad=param.requires_grad,
            )
            real.__dict__.update(param.__dict__)
            setattr(mod, name, real)
        for name, buf in mod.named_buffers(recurse=False):
            if buf.is_meta:
                raise ValueError(
                    f"{type(module).__name__}: buffer {mod_name}.{name} was built "
                    "on the meta device; build it on a real device"
                )
