"""A MoE layer's experts split over an expert-parallel group, tokens exchanged by all-to-all.

Rank r of a group of `ep` holds experts [r * E/ep, (r + 1) * E/ep) (contiguous, so expert e
lives on rank e // (E/ep)). `ParallelExperts` stands in for `transformers`' experts module of
an MoE block (same call: hidden (T, H), top-k expert ids and weights (T, k)); per layer:

1. every (token, choice) row is sorted by its expert and the per-expert counts are exchanged
   first (all-to-all of E integers), so each rank knows how many rows it receives from whom:
   dropless, uneven splits;
2. the rows go to their experts' ranks (all-to-all, differentiable: its backward is the
   reverse exchange of the gradients);
3. the rank runs its local experts on what it received with `transformers`' own experts
   module cut to those experts (its grouped-matmul path where torch has one on the device:
   one batched matmul over the local experts, not a loop);
4. the outputs come back by the reverse all-to-all, are weighted by the router's weights and
   summed over each token's k choices in the order `transformers` sums them.

Gradients of the local experts hold the contributions of the whole expert-parallel group's
tokens; averaging them over the expert-data-parallel group must count each token once
(`Topology.expert_data_groups`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from dsnd.tp.context import RankGroup

EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # (E, ., .) weights of transformers' experts


@dataclass(frozen=True)
class ExpertParallel(RankGroup):
    """This rank's expert-parallel group."""

    def local_range(self, experts: int) -> range:
        """The experts this rank holds, of `experts` per layer."""
        per_rank = experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def local_experts(experts: nn.Module, ep: ExpertParallel) -> nn.Module:
    """A copy of `transformers`' experts module holding only this rank's experts (their slices
    of every (E, ., .) tensor, and `num_experts` set to their count)."""
    total = experts.num_experts
    if total % ep.size:
        raise ValueError(f"{total} experts do not split over an expert-parallel group of {ep.size}")
    local = copy.copy(experts)  # shares the act_fn and config; parameters replaced below
    local._parameters = dict(experts._parameters)
    span = ep.local_range(total)
    for name in EXPERT_TENSORS:
        full = getattr(experts, name)
        local._parameters[name] = nn.Parameter(full.detach()[span.start : span.stop].clone(),
                                               requires_grad=full.requires_grad)  # fmt: skip
    local.num_experts = len(span)
    return local


class ParallelExperts(nn.Module):
    """Experts of one MoE layer over `ep`: this rank's share as `local` (see `local_experts`),
    called like the whole experts module; `num_experts` is the layer's total."""

    def __init__(self, local: nn.Module, num_experts: int, ep: ExpertParallel) -> None:
        super().__init__()
        self.local = local
        self.num_experts = num_experts
        self.ep = ep

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # rows grouped by expert, then by token
        rows = hidden[order // k]
        counts = torch.bincount(experts, minlength=self.num_experts).view(self.ep.size, -1)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep.group)  # [source, local expert]
        sent_splits, got_splits = counts.sum(1).tolist(), received.sum(1).tolist()
        mine = dist_fn.all_to_all_single(rows.new_empty(sum(got_splits), rows.shape[1]), rows,
                                         got_splits, sent_splits, group=self.ep.group)  # fmt: skip
        local_ids = torch.arange(counts.shape[1], device=hidden.device).repeat(self.ep.size)
        local_ids = local_ids.repeat_interleave(received.reshape(-1))
        out = self.local(mine, local_ids.unsqueeze(1),
                         torch.ones(len(local_ids), 1, dtype=top_k_weights.dtype,
                                    device=hidden.device))  # fmt: skip
        back = dist_fn.all_to_all_single(out.new_empty(rows.shape), out, sent_splits, got_splits,
                                         group=self.ep.group)  # fmt: skip
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
        return unsorted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)
