"""The module that holds this rank's layers (which ones: the plan's `stage_layers`)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dsnd.config.resolve import Resolved
from dsnd.cp import ContextParallel
from dsnd.distributed.groups import ProcessGroups
from dsnd.distributed.mpu import Mpu
from dsnd.engine.compat import nvme_param_swapper, use_hpz_group
from dsnd.engine.public import zero_init
from dsnd.model import LayerStack, layer_specs
from dsnd.model.documents import Documents
from dsnd.moe import ExpertParallel, moe_experts, parallelize_experts
from dsnd.tp.context import TensorParallel

log = logging.getLogger(__name__)


def tensor_parallel(res: Resolved, groups: ProcessGroups) -> TensorParallel:
    """This rank's tensor-parallel group; sequence parallelism only when it has several ranks."""
    sp = res.run.parallel.sequence_parallel and res.topology.tp > 1
    return TensorParallel(groups.tensor, sequence_parallel=sp)


def context_parallel(res: Resolved, groups: ProcessGroups) -> ContextParallel:
    """This rank's context-parallel group (of one rank without context parallelism)."""
    return ContextParallel(groups.context, res.run.parallel.cp_impl)


def expert_parallel(groups: ProcessGroups) -> ExpertParallel | None:
    """This rank's expert-parallel groups (ep > 1), else None."""
    return None if groups.expert is None else ExpertParallel(groups.expert, groups.expert_data)


def zero3_dtype(ds: dict) -> torch.dtype:
    """The dtype ZeRO-3 keeps parameters in: bf16 or fp16 when the JSON enables it, else fp32."""
    if (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def build_stage(
    res: Resolved,
    groups: ProcessGroups,
    documents: Documents | None = None,
    ep: ExpertParallel | None = None,
) -> LayerStack:
    """This rank's layers, initialised exactly as in the full model (seed, global index, name);
    with tp > 1 this rank's shard of each split tensor (`dsnd.model.parallelize`).

    Each layer is built on the meta device and given memory for this rank's shards only. With
    ZeRO-3 it is then handed to `deepspeed.zero.Init(module=...)` over the stage's
    data-parallel group, one layer at a time, so no rank ever holds its whole stage, let alone
    the model. With ep > 1 (`ep`, made here when not given) each MoE block keeps
    only this rank's experts, computed over its expert-parallel group (`dsnd.moe`); ZeRO-3
    partitions them over the expert-data-parallel group (`dsnd.engine.experts`). `documents`
    is what the layers read the micro-batch's documents from (`data.packing: documents`).
    """
    plan, stage = res.plan, groups.coord.pp
    use_hpz_group(groups.hpz)  # (the topology's hpz > 1 only at ZeRO-3)
    if groups.hpz is not None:
        log.info(
            "ZeRO++ hpZ: parameters' secondary partition over ranks %s",
            dist.get_process_group_ranks(groups.hpz),
        )
    prepare = _LayerPrep(res.ds, groups, ep or expert_parallel(groups), plan.zero_stage == 3)
    return LayerStack(
        layer_specs(
            res.model, tensor_parallel(res, groups), context_parallel(res, groups), documents
        ),
        res.run.train.seed,
        layer_indices=plan.stage_layers(stage),
        activation_checkpoint_interval=res.run.parallel.activation_checkpoint_interval,
        partition=prepare if prepare.needed else None,
        chunk_sizes=[len(plan.chunk_layers(stage, c)) for c in range(plan.chunks)],
    )


class _LayerPrep:
    """What happens to each layer once it is built on the meta device: its MoE blocks keep this
    rank's experts (`ep`), then ZeRO-3 partitions it (`zero.Init`), one layer at a time."""

    def __init__(
        self, ds: dict, groups: ProcessGroups, ep: ExpertParallel | None, zero3: bool
    ) -> None:
        self.ds, self.groups, self.ep, self.zero3 = ds, groups, ep, zero3
        self.swapper = None  # NVMe parameter offload: the stage's one swapper (see below)

    @property
    def needed(self) -> bool:
        return self.zero3 or self.ep is not None

    def __call__(self, layer: torch.nn.Module) -> None:
        if self.ep is not None:
            parallelize_experts(layer, self.ep)
        if self.zero3:
            self._partition(layer)

    def _partition(self, layer: torch.nn.Module) -> None:
        groups = self.groups
        # zero.Init as a context creates parameters in the run's dtype; handed a built module it
        # keeps their dtype, and a bf16 engine would then send fp32 activations between stages
        layer.to(zero3_dtype(self.ds))
        parts = [(layer, groups.data)]
        experts = moe_experts(layer) if self.ep is not None else None
        if experts is not None:  # a rank's experts first, over the ranks holding the same ones
            parts.insert(0, (experts, self.ep.data))  # (zero.Init of the layer then skips them)
        for module, group in parts:
            zero_init(
                module,
                data_parallel_group=group,
                config_dict_or_path=self.ds,
                mpu=Mpu(groups),  # so its config checks the batch against dp, not the world
                param_swapper=self.swapper,
                zero_param_parallel_group=groups.hpz if group is groups.data else None,
            )
            # every layer shares the first layer's NVMe swapper: a new one empties the swap
            # folder (the next read of an earlier layer's parameter then fails: z3-nvme of
            # `tests/distributed/test_offload.py`), and the
            # ZeRO-3 optimizer reaches every parameter's NVMe copy through the first
            # parameter's swapper
            self.swapper = self.swapper or nvme_param_swapper(module)
