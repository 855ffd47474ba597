"""Weights tied across pipeline stages (GPT-2's embedding and head).

DeepSpeed's pipeline keeps a copy of a tied module on every stage that uses it and all-reduces
the copies' gradients. Under ZeRO that makes two optimizer states for one weight, and ZeRO-3's
gradient norm (which ignores `ds_pipe_replicated`) counts it twice. dsnd keeps ONE owner:

- the owner stage (the first that uses the tie) holds the parameter, its optimizer state and its
  ZeRO shard;
- a borrower stage (the last, for a head) holds the module without parameters; at the start of
  every step the owner sends the full weight (gathered under ZeRO-3), the borrower uses it as a
  leaf tensor, and after its last backward sends that tensor's gradient back;
- the owner adds the borrowed gradient to its own local gradient before the step's data-parallel
  reduction: before its last backward under ZeRO-0 (whose engine all-reduces inside that
  backward), after it under ZeRO 1-3 (inside `coalesce_grad_reduction`, where every backward
  leaves local gradients on the parameters until the block's one reduction).

Both stages therefore compute with the same values by construction, the gradient is the sum over
both uses, and norm and clipping see the weight once. Ties within one stage need none of this:
`LayerStack` shares the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec
from torch import nn

from dsnd.distributed.groups import ProcessGroups
from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.model import LayerStack


def _resolve(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, name = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def _strip_parameters(module: nn.Module) -> None:
    """Turn every parameter of `module` into a plain tensor attribute (not trained here)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                del sub._parameters[name]
                setattr(sub, name, param.detach().clone())


@dataclass
class _Tie:
    owner: bool
    peer: int  # global rank of the other stage's rank with the same (dp, tp)
    holder: nn.Module  # the submodule whose attribute is the tied weight
    name: str
    shape: torch.Size
    dtype: torch.dtype
    borrowed: torch.Tensor | None = None


class TiedWeights:
    """This rank's side of every weight tied across stages (empty when none is)."""

    def __init__(
        self, stack: LayerStack, specs: list, parts: list[int], groups: ProcessGroups
    ) -> None:
        self.group = groups.pipe
        pipe_ranks = dist.get_process_group_ranks(groups.pipe)
        stage_of = {i: s for s in range(len(parts) - 1) for i in range(parts[s], parts[s + 1])}
        self.ties: list[_Tie] = []
        for key, attrs in stack.tied_weight_attrs.items():
            stages = sorted({stage_of[i] for i, spec in enumerate(specs)
                             if isinstance(spec, TiedLayerSpec) and spec.key == key})  # fmt: skip
            if len(stages) == 1:
                continue
            if len(stages) != 2:
                raise NotImplementedError(f"tie '{key}' spans stages {stages}; dsnd ties two")
            owner, borrower = stages
            me = groups.coord.pp
            module = stack.tied_modules[key]
            for attr in attrs:
                holder, name = _resolve(module, attr)
                weight = getattr(holder, name)
                tie = _Tie(owner=me == owner, peer=pipe_ranks[borrower if me == owner else owner],
                           holder=holder, name=name, dtype=weight.dtype,
                           shape=unpartitioned_shape(weight))  # fmt: skip
                self.ties.append(tie)
            if me == borrower:
                _strip_parameters(module)

    def begin_step(self, device: torch.device) -> None:
        """Owner: send the current full weight; borrower: receive it as this step's leaf."""
        for tie in self.ties:
            if tie.owner:
                param = getattr(tie.holder, tie.name)
                with deepspeed.zero.GatheredParameters([param]):  # no-op below ZeRO-3
                    dist.send(param.detach().clone(), tie.peer, group=self.group)
            else:
                buf = torch.empty(tie.shape, dtype=tie.dtype, device=device)
                dist.recv(buf, tie.peer, group=self.group)
                tie.borrowed = buf.requires_grad_()
                setattr(tie.holder, tie.name, tie.borrowed)

    def before_last_backward(self, zero0: bool) -> None:
        if zero0:
            self._owner_add_borrowed_grads()

    def after_last_backward(self, zero0: bool) -> None:
        for tie in self.ties:
            if not tie.owner:
                grad = tie.borrowed.grad
                if grad is None:
                    grad = torch.zeros_like(tie.borrowed)
                dist.send(grad.contiguous(), tie.peer, group=self.group)
                tie.borrowed = None
        if not zero0:
            self._owner_add_borrowed_grads()

    def _owner_add_borrowed_grads(self) -> None:
        for tie in self.ties:
            if tie.owner:
                param = getattr(tie.holder, tie.name)
                grad = torch.empty(tie.shape, dtype=tie.dtype, device=param.device)
                dist.recv(grad, tie.peer, group=self.group)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad.to(param.grad.dtype))
