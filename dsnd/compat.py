"""Shims for DeepSpeed 0.19.8 behaviour that dsnd's per-stage engines must work around.

ZeRO-3 checks its parameter trace with `assert_ints_same_as_other_ranks`, a WORLD-wide collective
(it takes no group). With pipeline stages holding different layers, ranks of different stages
compare different traces at different times and the job hangs (DESIGN.md). The check only makes
sense among the ranks that shard the same parameters: the stage's data-parallel group. DeepSpeed
imports the function by name into three modules, so the scoped version is installed in each.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

ZERO3_MODULES = (
    "deepspeed.runtime.zero.utils",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.partitioned_param_coordinator",
)


def scope_zero3_trace_checks(group: dist.ProcessGroup) -> None:
    """Make ZeRO-3's trace check compare only within `group` (the stage's data-parallel group)."""
    src = dist.get_process_group_ranks(group)[0]

    def assert_ints_same_in_group(ints: list[int]) -> None:
        # max and -min in one collective, so every rank sees the same verdict (no half-hang)
        bounds = torch.tensor([len(ints), -len(ints)], dtype=torch.long)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        if bounds[0].item() != -bounds[1].item():
            raise RuntimeError(f"ZeRO-3 trace lengths differ in the data-parallel group: {bounds}")
        first = torch.tensor(list(ints), dtype=torch.long)
        dist.broadcast(first, src=src, group=group)
        if first.tolist() != list(ints):
            raise RuntimeError(
                f"ZeRO-3 trace differs from rank {src}'s: {list(ints)} vs {first.tolist()}"
            )

    for name in ZERO3_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "assert_ints_same_as_other_ranks"):
            module.assert_ints_same_as_other_ranks = assert_ints_same_in_group
