"""Which layers this rank's stage holds, and the module that holds them."""

from __future__ import annotations

import deepspeed
import torch

from dsnd.config.resolve import Resolved
from dsnd.distributed.groups import ProcessGroups
from dsnd.distributed.mpu import Mpu
from dsnd.errors import UserError
from dsnd.model import LayerStack, layer_specs, param_groups
from dsnd.pipeline.partition import partition, stage_layers
from dsnd.tp.context import TensorParallel


def stage_parts(res: Resolved) -> list[int]:
    """Stage boundaries under `parallel.partition`: stage s holds global layers
    parts[s] .. parts[s + 1] - 1. Computed on the unsplit layers, so tensor parallelism never
    changes which layers a stage holds."""
    return partition(res.run.parallel.partition, layer_specs(res.model), res.topology.pp)


def _group_count(specs: list, indices: list[int], owned_ties: set[str]) -> int:
    """How many optimizer parameter groups a stage of these layers gets (built on meta)."""
    params = torch.nn.ModuleList()
    with torch.device("meta"):
        for i in indices:
            key = getattr(specs[i], "key", None)
            if key is None or key in owned_ties:
                params.append(specs[i].build())
    return len(param_groups(params))


def check_stages(res: Resolved) -> None:
    """Raise UserError now (before any rank starts) if the stages cannot be built and run.

    `parallel.partition` must give `parallel.pp` non-empty stages. Under ZeRO 1-3 DeepSpeed
    all-reduces the gradient norm once per parameter group over the model-parallel group, so
    every stage needs the same number of groups (decayed and undecayed parameters), or the
    stages would wait on each other for ever.
    """
    parts = stage_parts(res)
    zero = res.ds.get("zero_optimization", {}).get("stage", 0)
    if res.topology.pp == 1 or zero == 0:
        return
    specs = layer_specs(res.model)
    counts, owners = [], set()
    for stage in range(res.topology.pp):
        indices = stage_layers(parts, stage)
        new_ties = {specs[i].key for i in indices if getattr(specs[i], "key", None)} - owners
        owners |= new_ties
        counts.append(_group_count(specs, indices, new_ties))
    if len(set(counts)) > 1:
        raise UserError(
            f"parallel.partition={res.run.parallel.partition!r} gives stages {parts} whose "
            f"optimizer parameter groups differ ({counts} per stage: decayed matrices and/or "
            f"undecayed norms, biases, embeddings); with ZeRO-{zero} DeepSpeed reduces the "
            "gradient norm per group across stages, which would hang: choose a partition "
            "where every stage holds a transformer block (e.g. 'parameters')"
        )


def tensor_parallel(res: Resolved, groups: ProcessGroups) -> TensorParallel:
    """This rank's tensor-parallel group; sequence parallelism only when it has several ranks."""
    sp = res.run.parallel.sequence_parallel and res.topology.tp > 1
    return TensorParallel(groups.tensor, sequence_parallel=sp)


def zero3_dtype(ds: dict) -> torch.dtype:
    """The dtype ZeRO-3 keeps parameters in: bf16 or fp16 when the JSON enables it, else fp32."""
    if (ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def build_stage(res: Resolved, groups: ProcessGroups) -> LayerStack:
    """This rank's layers, initialised exactly as in the full model (seed, global index, name);
    with tp > 1 this rank's shard of each split tensor (`dsnd.model.parallelize`).

    Each layer is built on the meta device and given memory for this rank's shards only. With
    ZeRO-3 it is then handed to `deepspeed.zero.Init(module=...)` over the stage's
    data-parallel group, one layer at a time, so no rank ever holds its whole stage, let alone
    the model.
    """
    zero3 = res.ds.get("zero_optimization", {}).get("stage", 0) == 3
    indices = stage_layers(stage_parts(res), groups.coord.pp)

    def partition(layer: torch.nn.Module) -> None:
        # zero.Init as a context creates parameters in the run's dtype; handed a built module it
        # keeps their dtype, and a bf16 engine would then send fp32 activations between stages
        layer.to(zero3_dtype(res.ds))
        deepspeed.zero.Init(
            module=layer,
            data_parallel_group=groups.data,
            config_dict_or_path=res.ds,
            mpu=Mpu(groups),  # so its config checks the batch against dp, not the world
        )

    return LayerStack(
        layer_specs(res.model, tensor_parallel(res, groups)),
        res.run.train.seed,
        layer_indices=indices,
        activation_checkpoint_interval=res.run.parallel.activation_checkpoint_interval,
        partition=partition if zero3 else None,
    )
