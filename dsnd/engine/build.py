"""Build a DeepSpeed engine (ZeRO 0-3) for one pipeline stage, and the replica gradient norm."""

from __future__ import annotations

import logging
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter  # the rule ZeRO's norm uses
from torch import nn

from dsnd.engine.compat import quiet_scheduler_start, undo_unfused_init_step

log = logging.getLogger(__name__)


def build_engine(model: nn.Module, ds_config: dict[str, Any], param_groups: list[dict], mpu: Any):
    """`deepspeed.initialize` on a process group that already exists: the optimizer's parameter
    groups and an mpu (whose data-parallel group is the stage's) are the caller's."""
    with quiet_scheduler_start():
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups,
            config=ds_config,
            mpu=mpu,
            dist_init_required=False,
        )
    undo_unfused_init_step(engine)
    return engine


def replica_grad_norm(module: nn.Module, group: dist.ProcessGroup, tp_rank: int) -> float:
    """L2 norm of the full gradients of one model replica, summed over `group` (its stages and
    tensor-parallel ranks).

    DeepSpeed's ZeRO-0 fp32 path clips without keeping the norm, so dsnd measures it at the
    accumulation boundary, before the optimizer step, as ZeRO 1-3 report it (pre-clipping).
    As in DeepSpeed, a parameter not split by tensor parallelism (identical on every
    tensor-parallel rank) is counted on tensor-parallel rank 0 only. A rank holds only its
    experts (`dsnd.moe`): theirs are first summed over the expert-parallel group.
    """
    device = next(module.parameters()).device
    dense = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    ep_group = None
    for p in module.parameters():
        ep = getattr(p, "expert_parallel", None)
        ep_group = ep.group if ep is not None else ep_group  # with or without a gradient
        if p.grad is not None and (tp_rank == 0 or is_model_parallel_parameter(p)):
            (dense if ep is None else experts).add_(p.grad.detach().double().pow(2).sum())
    if ep_group is not None:
        dist.all_reduce(experts, group=ep_group)
    total = dense + experts
    dist.all_reduce(total, group=group)
    return total.sqrt().item()
