"""An MoE stage's numbers of one step, asked for once per step by the trainer (as torchtitan's
metrics processor): tokens per expert and their balance, the (token, choice) rows expert
parallelism sent off-rank, the rows dropped at capacity, and the routers' load-balancing loss.
The training loop keeps its dense shape; only this module knows what an MoE layer counts."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsnd.moe.capacity import Capacity
from dsnd.moe.router_load import RouterLoad


class MoeNumbers:
    """The counters of one stage (`RouterLoad`, the `Capacity` when the run caps experts) and
    how a step's numbers are made from them; `expert_parallel` when ep > 1."""

    def __init__(
        self,
        load: RouterLoad,
        capacity: Capacity | None,
        expert_parallel: bool,
        device: torch.device,
    ) -> None:
        self.load, self.capacity = load, capacity
        self.expert_parallel, self.device = expert_parallel, device

    def step(self, aux_loss: float | None) -> tuple[dict[str, Any], dict[str, float]]:
        """The step's metrics.jsonl fields and TensorBoard tags (collective: the counts are
        summed over the world); `aux_loss` is the routers' loss over the global batch, when the
        model adds it (part of the step's loss, as transformers reports it)."""
        load, sent = self.load.gathered(self.device)
        tags, counts = expert_load(load, sent)
        row: dict[str, Any] = {"moe_tokens_per_expert": counts}
        if aux_loss is not None:
            row["moe_aux_loss"] = tags["moe/aux_loss"] = aux_loss
        if self.expert_parallel:  # (token, choice) rows each layer's all-to-all sent off-rank
            row["moe_rows_sent"] = {b: int(sent[int(b)]) for b in counts}
        if self.capacity is not None:  # rows over their expert's capacity, all ranks
            dropped = self.capacity.take().to(self.device)
            dist.all_reduce(dropped)
            row["moe_dropped_tokens"] = {b: int(dropped[int(b)]) for b in counts}
            for b, n in row["moe_dropped_tokens"].items():
                tags[f"moe/layer{b}_dropped_share"] = n / sum(counts[b])
        return row, tags


def expert_load(
    load: list[list[float]], sent: list[float] | None = None
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """From `RouterLoad.gathered` (per block, tokens per expert and rows sent to other
    expert-parallel ranks): TensorBoard tags per MoE layer, its busiest and idlest expert over
    the mean (1 and 1: perfectly balanced) and, with expert parallelism, the share of its
    (token, choice) rows the all-to-all sends off-rank, and the metrics.jsonl counts by block
    number. Dense blocks (no tokens counted) are left out."""
    tags: dict[str, float] = {}
    counts: dict[str, list[int]] = {}
    for block, row in enumerate(load):
        total = sum(row)
        if total == 0:
            continue
        mean = total / len(row)
        tags[f"moe/layer{block}_load_max_over_mean"] = max(row) / mean
        tags[f"moe/layer{block}_load_min_over_mean"] = min(row) / mean
        if sent is not None and sent[block]:
            tags[f"moe/layer{block}_sent_share"] = sent[block] / total
        counts[str(block)] = [int(c) for c in row]
    return tags, counts
