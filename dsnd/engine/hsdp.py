"""Hybrid sharded data parallelism (`parallel.dp_shard`) on DeepSpeed 0.19.8's ZeRO-3.

ZeRO-3 partitions a stage's parameters, gradients and optimizer state over a shard group of
`dp_shard` ranks and the stage's `dp / dp_shard` shard groups hold identical replicas: each
rank keeps 1/dp_shard of the model states, and parameter all-gathers never leave the shard group
(a host, when the shard groups are hosts). Gradients must still be averaged over all dp ranks.

DeepSpeed's own version of this, MiCS (`zero_optimization.mics_shard_size`,
`deepspeed.zero.MiCS_Init`, `MiCS_Optimizer`), is gone from 0.19.8 (there the module
`deepspeed.runtime.zero.mics` does not exist, `deepspeed.zero` has no `MiCS_Init`, and
`deepspeed.initialize` with `mics_shard_size` raises DeepSpeedConfigError "MiCS ZeRO-3 sharding
has been removed; 'zero_optimization.mics_shard_size' is no longer supported."). So dsnd builds
it from plain ZeRO-3, as MiCS was built:

- each stage's engine and its `deepspeed.zero.Init` are handed the shard group as their
  data-parallel group (`dsnd.distributed.groups.ProcessGroups.shard`); the mpu still answers the
  full dp for the batch arithmetic;
- ZeRO-3 reduce-scatters each gradient bucket over the shard group (averaging over it) and
  hands the partitions to `partition_grads` (its one place for every bucket, contiguous or not,
  before accumulation and any offload); `replicate_gradients` wraps that method on the
  optimizer so that the partitions are first averaged over the replica group (the ranks holding
  the same shard index in the other shard groups), one all-reduce per bucket. Replicas then hold
  the same gradient partition, so the norm, clipping, overflow check and optimizer step (all over
  the shard group) agree on every replica and the replicas stay equal, as FSDP's hybrid
  sharding does it (every backward, not only at the accumulation boundary: ZeRO-3 reduces each
  micro-batch's gradients anyway).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def replicate_gradients(optimizer: Any, group: dist.ProcessGroup) -> None:
    """Make the ZeRO-3 `optimizer` average each bucket's gradient partitions over `group` (the
    replicas of this rank's shard) before it keeps them (see above)."""
    replicas = dist.get_world_size(group)
    log.info(
        "HSDP: ZeRO-3 shards over ranks %s, gradients averaged with ranks %s",
        dist.get_process_group_ranks(optimizer.dp_process_group),
        dist.get_process_group_ranks(group),
    )
    partition_grads = optimizer.partition_grads  # the bound method, DeepSpeed's own

    def averaged_partition_grads(params: list, grad_partitions: list[torch.Tensor]) -> Any:
        if grad_partitions:
            flat = torch.cat([g.reshape(-1) for g in grad_partitions])
            dist.all_reduce(flat, group=group)
            flat.div_(replicas)
            offset = 0
            for g in grad_partitions:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return partition_grads(params, grad_partitions)

    optimizer.partition_grads = averaged_partition_grads
