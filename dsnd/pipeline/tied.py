"""Weights tied across pipeline stages (GPT-2's embedding and head).

DeepSpeed's pipeline keeps a copy of a tied module on every stage that uses it and all-reduces
the copies' gradients. Under ZeRO that makes two optimizer states for one weight, and ZeRO-3's
gradient norm (which ignores `ds_pipe_replicated`) counts it twice. dsnd keeps ONE owner:

- the owner stage (the first that uses the tie) holds the parameter, its optimizer state and its
  ZeRO shard;
- a borrower stage (the last, for a head) holds the module without parameters; at the start of
  every step the owner sends the full weight (gathered under ZeRO-3), the borrower uses it as a
  leaf tensor, and after its last backward sends that tensor's gradient back;
- the owner adds the borrowed gradient to its own local gradient after its last backward and
  before the step's data-parallel reduction (every backward leaves local gradients on the
  parameters until that reduction: `dsnd.engine.stage_engine`).

The schedule places the four moves (`tied_lend`, `tied_borrow`, `tied_return`, `tied_add`) in
each stage's program; the plan says which stages own and borrow (`dsnd.plan.plan.Tie`).

Both stages therefore compute with the same values by construction, the gradient is the sum over
both uses, and norm and clipping see the weight once. Ties within one stage need none of this:
`LayerStack` shares the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsnd.distributed.groups import ProcessGroups
from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.engine.public import gathered_parameters
from dsnd.model import LayerStack
from dsnd.plan.plan import Tie


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
    group: dist.ProcessGroup  # the two ranks' own group (`ProcessGroups.pairs`)
    holder: nn.Module  # the submodule whose attribute is the tied weight
    name: str
    shape: torch.Size
    dtype: torch.dtype
    borrowed: torch.Tensor | None = None


class TiedWeights:
    """This rank's side of every weight tied across stages (empty when none is)."""

    def __init__(self, stack: LayerStack, ties: tuple[Tie, ...], groups: ProcessGroups) -> None:
        pipe_ranks = dist.get_process_group_ranks(groups.pipe)
        me = groups.coord.pp
        self.ties: list[_Tie] = []
        for tie in ties:
            # the owner and the borrower exchange on a group of their own: on NCCL the pipe
            # group's messages between two ranks share one in-order stream with its loss
            # broadcast (eager mode), which the exchange then depends on (`build_groups`)
            group = groups.pairs[tie.owner, tie.borrower]
            if me not in (tie.owner, tie.borrower):
                continue
            module = stack.tied_modules[tie.key]
            for attr in stack.tied_weight_attrs[tie.key]:
                holder, name = _resolve(module, attr)
                weight = getattr(holder, name)
                peer = pipe_ranks[tie.borrower if me == tie.owner else tie.owner]
                shape = unpartitioned_shape(weight)
                self.ties.append(
                    _Tie(
                        owner=me == tie.owner,
                        peer=peer,
                        group=group,
                        holder=holder,
                        name=name,
                        dtype=weight.dtype,
                        shape=shape,
                    )
                )
            if me == tie.borrower:
                _strip_parameters(module)

    def __bool__(self) -> bool:
        return bool(self.ties)

    def lend(self) -> None:
        """Owner: send the current full weight (the borrower computes with it this step)."""
        for tie in self.ties:
            if tie.owner:
                param = getattr(tie.holder, tie.name)
                with gathered_parameters([param]):  # no-op below ZeRO-3
                    dist.send(param.detach().clone(), tie.peer, group=tie.group)

    def borrow(self, device: torch.device) -> None:
        """Borrower: receive the weight as this step's leaf tensor."""
        for tie in self.ties:
            if not tie.owner:
                buf = torch.empty(tie.shape, dtype=tie.dtype, device=device)
                dist.recv(buf, tie.peer, group=tie.group)
                tie.borrowed = buf.requires_grad_()
                setattr(tie.holder, tie.name, tie.borrowed)

    def borrowed_leaves(self) -> list[torch.Tensor]:
        """The borrowed weights, whose gradients a split backward must compute too."""
        return [t.borrowed for t in self.ties if not t.owner and t.borrowed is not None]

    def give_back(self) -> None:
        """Borrower, after its last backward: send the borrowed weight's gradient home."""
        for tie in self.ties:
            if not tie.owner:
                grad = tie.borrowed.grad
                if grad is None:
                    grad = torch.zeros_like(tie.borrowed)
                dist.send(grad.contiguous(), tie.peer, group=tie.group)
                tie.borrowed = None

    def add_returned(self) -> None:
        """Owner, after its own last backward and before the reduction: add the gradient the
        borrower sends to the weight's local gradient."""
        for tie in self.ties:
            if tie.owner:
                param = getattr(tie.holder, tie.name)
                grad = torch.empty(tie.shape, dtype=tie.dtype, device=param.device)
                dist.recv(grad, tie.peer, group=tie.group)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad.to(param.grad.dtype))
