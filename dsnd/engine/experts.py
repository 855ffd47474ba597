"""Expert parameters under ZeRO: sharded and averaged over the expert-data-parallel group.

With expert parallelism (`parallel.ep` > 1) a rank holds only its experts of each MoE layer
(`dsnd.moe`: parameters carrying their ``expert_parallel`` groups). The ranks holding the same
experts are the expert-data-parallel group (dp / ep ranks of the stage, times cp); the other
ranks of the stage hold other experts. So ZeRO must keep those parameters apart from the dense
ones: shard their model states over that group, reduce their gradients over it, and divide by
the stage's whole data-parallel size (a rank's expert gradient already sums the tokens of its
expert-parallel group). The gradient norm must count each expert once: summed over the expert-
data-parallel group (disjoint partitions), the expert-parallel group (different experts) and the
pipeline stages.

DeepSpeed 0.19.8 does this itself, by two mechanisms, which dsnd drives:

- ZeRO 0-2, DeepSpeed's MoE support: a parameter with ``allreduce = False`` and a
  ``group_name`` is an expert parameter (`deepspeed.moe.utils.is_moe_param`); the engine puts
  such parameters into their own optimizer groups (`configure_moe_param_groups`), ZeRO 1-2
  partitions those over ``groups._EXPERT_DATA_PARALLEL_GROUP[group_name]`` and divides their
  reduced gradients by the full data-parallel size, ZeRO-0 all-reduces them over that group
  divided by the data-parallel size (`_reduce_expert_gradients`), and the ZeRO 1-2 norm sums
  every partition over the data-parallel group. The engine switches this on only when its
  module holds a `deepspeed.moe.layer.MoE` (`has_moe_layers`, read in `_configure_distributed_
  model`); dsnd's experts are not DeepSpeed's MoE layer, so `prepare` adds an empty marker of
  that class to the stage (no parameters, never called; its `set_deepspeed_parallelism`, which
  would create world-wide groups, does nothing). DeepSpeed's groups are module globals
  (`deepspeed.utils.groups._EXPERT_PARALLEL_GROUP` / `_EXPERT_DATA_PARALLEL_GROUP` and their
  rank lists): `prepare` sets them to this stage's groups before each engine is built.
- ZeRO-3 refuses DeepSpeed's MoE layer but partitions each parameter over the group its
  `deepspeed.zero.Init` was given (``ds_process_group``; sub-groups, buckets and the fp32
  masters follow it): `dsnd.pipeline.stage` partitions the experts over the expert-data-parallel
  group. Two things then differ from what experts need, and `after_build` corrects them on the
  built optimizer: its reduce-scatter averages over the partition group (`_gradient_averaging_
  world_size`, answered here with the data-parallel size for expert parameters, as DeepSpeed
  answers it for its own AutoEP experts), and its norm of an expert sub-group covers this rank's
  experts only (`_get_norm_groups`: the squares are summed over the expert-parallel group here).
  DeepSpeed's AutoEP placement (``ds_zero_placement_family``) would do both, but it also skips
  the model-parallel sum of the norm, which across pipeline stages is needed.

ZeRO-0 fp32 clips in `engine.clip_fp32_gradients` with `deepspeed.runtime.utils.clip_grad_norm_`,
which averages the ranks' norms over the data-parallel group: right when every rank holds the
same parameters, not when ranks hold different experts. `after_build` replaces it on the engine
with the same clipping by the replica's true norm (`replica_grad_norm`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups as ds_groups
from torch import nn

from dsnd.engine.build import replica_grad_norm


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` that hold part of the experts (`dsnd.moe`)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", None) is not None]


class _Marker(MoE):
    """Tells a DeepSpeed engine that its module has MoE layers (see the module docstring)."""

    def __init__(self, num_experts: int) -> None:
        nn.Module.__init__(self)  # not MoE's: no experts, gate or groups of its own
        self.num_experts = num_experts

    def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
        pass


def prepare(
    module: nn.Module,
    zero_stage: int,
    ep_group: dist.ProcessGroup | None,
    data_group: dist.ProcessGroup | None,
) -> None:
    """Before `deepspeed.initialize` of `module` (a stage) with split experts: DeepSpeed's
    expert groups named for this stage's (`ep_group`, the expert-data-parallel `data_group`);
    at ZeRO 0-2 its expert parameters marked as DeepSpeed's. Nothing without split experts."""
    params = expert_params(module)
    if not params:
        return
    name = f"ep_size_{dist.get_world_size(ep_group)}"
    # added, not replaced: a ZeRO-0 engine looks its groups up by name at every reduction
    ds_groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = data_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep_group)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(data_group)
    if zero_stage == 3:
        return
    for p in params:
        p.allreduce = False
        p.group_name = name
    module.add_module("deepspeed_moe_marker", _Marker(len(params)))


def after_build(engine: Any, ep_group: dist.ProcessGroup | None) -> None:
    """The corrections for expert parameters on a built `engine` (see the module docstring):
    ZeRO-3's averaging and norm, ZeRO-0's clipping; nothing without split experts."""
    if not expert_params(engine.module):
        return
    if engine.zero_optimization_stage() == 0:
        engine.clip_fp32_gradients = lambda: _clip_replica(engine)
    if engine.zero_optimization_stage() != 3:
        return
    opt = engine.optimizer
    dp = dist.get_world_size(opt.dp_process_group)
    averaging = opt._gradient_averaging_world_size
    norm_groups = opt._get_norm_groups

    def averaging_world_size(params: list, partition_world_size: int) -> int:
        if params and getattr(params[0], "expert_parallel", None) is not None:
            return dp
        return averaging(params, partition_world_size)

    def norms() -> list[torch.Tensor]:
        out = norm_groups()
        for i, group in enumerate(opt.fp16_groups):
            if group and getattr(group[0], "expert_parallel", None) is not None:
                out[i] = _sum_over(out[i], ep_group)
        return out

    opt._gradient_averaging_world_size = averaging_world_size
    opt._get_norm_groups = norms


def _clip_replica(engine: Any) -> None:
    """ZeRO-0 fp32's clipping (DeepSpeed's `clip_fp32_gradients`) by the replica's norm with
    each expert counted once. DeepSpeed's `clip_grad_norm_` averages the ranks' norms over the
    data-parallel group instead, which differs once ranks hold different experts. Same
    coefficient as DeepSpeed's: max_norm / (norm + 1e-6), at most 1."""
    mpu = engine.mpu
    norm = replica_grad_norm(
        engine.module, mpu.get_model_parallel_group(), mpu.get_model_parallel_rank()
    )
    coef = min(1.0, engine.gradient_clipping() / (norm + 1e-6))
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)


def _sum_over(norm: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The L2 norm of what `group`'s ranks hold apart (`norm` each); negative (DeepSpeed's mark
    of an invalid norm) if any rank's is."""
    norm = torch.as_tensor(norm)
    both = torch.stack([norm.double() ** 2, (norm < 0).double()])
    both = both.to(get_accelerator().current_device_name())  # where the backend reduces
    dist.all_reduce(both, group=group)
    total = torch.tensor(-1.0) if both[1] > 0 else both[0].sqrt()
    return total.to(dtype=norm.dtype, device=norm.device)
