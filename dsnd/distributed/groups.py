"""Process groups, built once from the topology and passed explicitly (never module globals).

`torch.distributed.new_group` must be called by every rank for every group, in the same order,
so each axis's full list of groups is created everywhere and each rank keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dsnd.topology import Coord, Topology


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the topology and its groups along each axis."""

    topology: Topology
    rank: int
    coord: Coord
    pipe: dist.ProcessGroup  # the stages of one pipeline (same dp, tp)
    data: dist.ProcessGroup  # replicas of this rank's shard (same pp, tp): ZeRO shards here
    tensor: dist.ProcessGroup  # the tensor-parallel peers of this rank (same pp, dp)
    replica: dist.ProcessGroup  # one full model replica: every pp x tp rank of this dp index

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.topology.pp - 1


def _own_group(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in no group of {groups}"
    return mine


def build_groups(topology: Topology) -> ProcessGroups:
    """Create every group of `topology`; needs an initialised default process group."""
    rank = dist.get_rank()
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != topology {topology}")
    return ProcessGroups(
        topology=topology,
        rank=rank,
        coord=topology.coord(rank),
        pipe=_own_group(topology.groups("pipe"), rank),
        data=_own_group(topology.groups("data"), rank),
        tensor=_own_group(topology.groups("model"), rank),
        replica=_own_group(topology.model_parallel_groups(), rank),
    )


def hpz_group(topology: Topology, rank: int, size: int) -> dist.ProcessGroup:
    """ZeRO++ hpZ (`zero_hpz_partition_size`): this rank's group for ZeRO-3's secondary
    parameter partition, `size` consecutive ranks of its stage's data-parallel group (DeepSpeed
    would cut its own from the whole world, across stages). Every rank creates every group."""
    chunks = [ranks[i : i + size] for ranks in topology.groups("data")
              for i in range(0, len(ranks), size)]  # fmt: skip
    return _own_group(chunks, rank)
