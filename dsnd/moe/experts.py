"""A MoE layer's experts computed over an expert-parallel group, tokens exchanged by all-to-all.

Rank r of a group of `ep` computes experts [r * E/ep, (r + 1) * E/ep) (contiguous, so expert e
runs on rank e // (E/ep)). `ParallelExperts` takes the place of `transformers`' experts module
of an MoE block (same call: hidden (T, H), top-k expert ids and weights (T, k); same parameter
names and shapes); per layer:

1. every (token, choice) row is sorted by its expert and the per-expert counts (`expert_counts`,
   on the device) are exchanged first (all-to-all of E integers), so each rank knows how many
   rows it receives from whom: dropless, uneven splits. Reading those split sizes back is the
   layer's one device-to-host sync;
2. the rows go to their experts' ranks (all-to-all, differentiable: its backward is the
   reverse exchange of the gradients);
3. the rank runs its experts on what it received with `transformers`' own experts code on
   those experts' slices of the (E, ., .) weights (its grouped-matmul path where torch has one
   on the device: one batched matmul over the local experts, not a loop);
4. the outputs come back by the reverse all-to-all, are weighted by the router's weights and
   summed over each token's k choices in the order `transformers` sums them.

Each rank keeps only its own experts: the module's `gate_up_proj` / `down_proj` are this rank's
(E/ep, ., .) slices of the layer's (E, ., .) tensors, under the layer's own names, marked as a
shard along dim 0 over the expert-parallel group (``tp_shard``, a `dsnd.tp.shard.Shard`, and
``expert_parallel``, the groups) so that initialisation, `transformers` import and export and
checkpoints read and write the whole tensors as one process has them. ZeRO keeps them apart from
the dense parameters (`dsnd.engine.experts`): sharded over, and averaged over, the expert-data-
parallel group (the dp / ep ranks holding the same experts). A rank's gradient of its experts
holds the contributions of every token of its expert-parallel group; averaged with the dp / ep
replicas over all dp ranks' tokens, each expert's gradient counts each token once, as in one
process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsnd.moe.counts import expert_counts
from dsnd.tp.context import RankGroup
from dsnd.tp.shard import Shard

EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # (E, ., .) weights of transformers' experts


@dataclass(frozen=True)
class ExpertParallel(RankGroup):
    """This rank's expert-parallel group (`group`) and its expert-data-parallel group (`data`:
    the ranks that hold the same experts)."""

    data: dist.ProcessGroup

    def local_range(self, experts: int) -> range:
        """The experts this rank computes, of `experts` per layer."""
        if experts % self.size:
            raise ValueError(
                f"{experts} experts do not split over an expert-parallel group of {self.size}"
            )
        per_rank = experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class _Exchange(torch.autograd.Function):
    """Rows over `group`: rank j gets `sent[j]` of the rows (in order) and this rank `got[i]`
    from rank i; backward is the reverse exchange of the gradients. Written here because
    torch 2.13 deprecates its own autograd all-to-all (`torch.distributed.nn.functional.
    all_to_all_single`), and its functional successor's collectives are not c10d's
    `alltoall_base_`, which `dsnd bench moe` counts."""

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, got: list[int], sent: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.got, ctx.sent, ctx.group = got, sent, group
        out = rows.new_empty(sum(got), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), got, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.sent), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.got, group=ctx.group)
        return back, None, None, None


def _splits(counts: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows this rank sends to and gets from each rank of the group ((ep, E/ep) counts each):
    the all-to-all needs them on the host, so they are read back once, together, the one
    device-to-host sync of the layer. Everything else that depends on them is given them
    (`repeat_interleave`'s output_size) rather than reading the device again."""
    sent, got = torch.stack([counts.sum(1), received.sum(1)]).tolist()
    return sent, got


class ParallelExperts(nn.Module):
    """`experts` (a `transformers` experts module) over `ep`: this rank's `local_range` of its
    (E, ., .) parameters, as parameters of their own (see the module docstring)."""

    def __init__(self, experts: nn.Module, ep: ExpertParallel) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.span = ep.local_range(self.num_experts)
        self.ep = ep
        for name in EXPERT_TENSORS:
            whole = experts._parameters.pop(name)
            local = nn.Parameter(
                whole.detach()[self.span.start : self.span.stop].clone(),
                requires_grad=whole.requires_grad,
            )
            local.__dict__.update(whole.__dict__)  # dsnd's marks (partial_grad under SP)
            local.tp_shard = Shard(0, ep.rank, ep.size, self.num_experts)
            local.expert_parallel = ep  # the shard is over ep.group; ep.data holds copies
            self.register_parameter(name, local)
        # `transformers`' module, unregistered and without parameters: its code, activation and
        # config compute the local experts (`_local`)
        self._code = (experts,)

    def _local(self) -> nn.Module:
        """`transformers`' experts module over this rank's experts (the parameters themselves,
        so gradients land in them)."""
        view = copy.copy(self._code[0])
        view._parameters = {name: getattr(self, name) for name in EXPERT_TENSORS}
        view.num_experts = len(self.span)
        return view

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # rows grouped by expert, then by token
        rows = hidden[order // k]
        counts = expert_counts(experts, self.num_experts).view(self.ep.size, -1)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep.group)  # [source, local expert]
        sent_splits, got_splits = _splits(counts, received)
        mine = _Exchange.apply(rows, got_splits, sent_splits, self.ep.group)
        local_ids = torch.arange(counts.shape[1], device=hidden.device).repeat(self.ep.size)
        local_ids = local_ids.repeat_interleave(received.reshape(-1), output_size=sum(got_splits))
        ones = torch.ones(len(local_ids), 1, dtype=top_k_weights.dtype, device=hidden.device)
        # the module's forward, not its __call__: the view shares its hooks' dictionaries
        out = self._local().forward(mine, local_ids.unsqueeze(1), ones)
        back = _Exchange.apply(out, sent_splits, got_splits, self.ep.group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
        return unsorted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def moe_experts(layer: nn.Module) -> nn.Module | None:
    """`layer`'s MoE experts module (`mlp.experts`, as every `transformers` MoE family names
    it, or the `ParallelExperts` in its place), or None in a dense layer."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None or not all(hasattr(experts, n) for n in EXPERT_TENSORS):
        return None
    return experts


def parallelize_experts(block: nn.Module, ep: ExpertParallel) -> bool:
    """Put `ParallelExperts` in the place of `block`'s MoE experts; False where the block has
    none (a dense layer)."""
    experts = moe_experts(block)
    if experts is None:
        return False
    if ep.size > 1:
        block.mlp.experts = ParallelExperts(experts, ep)
    return True
