"""Process groups, built once from the topology and passed explicitly (never module globals).

`torch.distributed.new_group` must be called by every rank for every group, in the same order,
so each axis's full list of groups is created everywhere and each rank keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from dsnd.topology import Coord, Topology


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the topology and its groups along each axis."""

    topology: Topology
    rank: int
    coord: Coord
    pipe: dist.ProcessGroup  # the stages of one pipeline (same dp, cp, tp)
    # every rank holding the same parameters as this one (same pp, tp; all dp x cp): ZeRO
    # shards over it and averages gradients over it (context-parallel peers computed parts of
    # the same sequences' gradients, so they reduce together, as Megatron does)
    data: dist.ProcessGroup
    tensor: dist.ProcessGroup  # the tensor-parallel peers of this rank (same pp, dp, cp)
    context: dist.ProcessGroup  # the ranks holding slices of the same sequences (same pp, dp, tp)
    replica: dist.ProcessGroup  # one full model replica: every pp x tp rank of this dp, cp

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
        data=_own_group(topology.zero_groups(), rank),
        tensor=_own_group(topology.groups("model"), rank),
        context=_own_group(topology.groups("context"), rank),
        replica=_own_group(topology.model_parallel_groups(), rank),
    )


def hpz_group(topology: Topology, rank: int, size: int) -> dist.ProcessGroup:
    """ZeRO++ hpZ (`zero_hpz_partition_size`): this rank's group for ZeRO-3's secondary
    parameter partition, `size` consecutive ranks of its stage's data-parallel group (DeepSpeed
    would cut its own from the whole world, across stages). Every rank creates every group."""
    return _own_group(_consecutive(topology, size), rank)


def expert_groups(topology: Topology, rank: int, ep: int
                  ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:  # fmt: skip
    """Expert parallelism (`parallel.ep`): this rank's group of `ep` consecutive data-parallel
    ranks of its stage (`Topology.expert_groups`), which split the MoE layers' experts, and its
    expert-data-parallel group (`Topology.expert_data_groups`: the ranks holding the same
    experts, over which ZeRO shards and averages them). Every rank creates every group."""
    return (_own_group(topology.expert_groups(ep), rank),
            _own_group(topology.expert_data_groups(ep), rank))  # fmt: skip


def _consecutive(topology: Topology, size: int) -> list[list[int]]:
    """Every stage's ZeRO group cut into runs of `size` consecutive ranks."""
    return [ranks[i : i + size] for ranks in topology.zero_groups()
            for i in range(0, len(ranks), size)]  # fmt: skip


def dp_shard_groups(groups: ProcessGroups, size: int | None
                    ) -> tuple[ProcessGroups, dist.ProcessGroup | None]:  # fmt: skip
    """Hybrid sharding (`parallel.dp_shard`): `groups` with `data` cut to this rank's shard
    group — `size` consecutive ranks of its stage's data-parallel group, what ZeRO-3 partitions
    over — and the replica group: the ranks at the same place in the stage's other shard groups,
    over which gradients are averaged (`dsnd.engine.hsdp`). Consecutive ranks, so with a host's
    ranks in a row the shard groups stay inside hosts. `coord` and the topology stay the whole
    layout's (the batch and the data still count dp). Every rank creates every group. A size of
    None, 0 or the whole data group: (`groups`, None), nothing created."""
    data = groups.topology.zero_groups()
    if not size or size == len(data[0]):
        return groups, None
    replicas = [ranks[i::size] for ranks in data for i in range(size)]
    shard = _own_group(_consecutive(groups.topology, size), groups.rank)
    return replace(groups, data=shard), _own_group(replicas, groups.rank)


def pipe_channels(stages: int, ring: bool) -> list[tuple[int, int, str]]:
    """Every one-way message channel of a pipeline of `stages` stages, as (from stage, to stage,
    kind): activations forward and gradients back between neighbours, and with `ring`
    (interleaved schedules: the last stage's chunk c feeds the first stage's chunk c + 1) the
    same between the last stage and the first."""
    pairs = [(s, s + 1) for s in range(stages - 1)]
    if ring and stages > 1:
        pairs.append((stages - 1, 0))
    return [ch for a, b in pairs for ch in ((a, b, "act"), (b, a, "grad"))]


def channel_groups(topology: Topology, rank: int, ring: bool
                   ) -> dict[tuple[int, int, str], dist.ProcessGroup]:  # fmt: skip
    """This rank's two-rank process group for each pipeline channel it sends or receives on
    (`pipe_channels`), one group per channel and direction.

    Why a group each: on NCCL the messages between two ranks of one group run in issue order on
    one stream, tags ignored, so a receive posted on the pipe group ahead of a send to the same
    peer holds that send back, and 1F1B's steady state (an activation going forward while a
    gradient comes back) deadlocks. With one group per channel a stream carries one direction
    of one kind of message, whose sends and receives `dsnd.plan.schedule.simulate` checks come
    in the same order. Every rank creates every pipeline's groups, in the same order."""
    channels = pipe_channels(topology.pp, ring)
    mine: dict[tuple[int, int, str], dist.ProcessGroup] = {}
    for ranks in topology.groups("pipe"):
        for src, dst, kind in channels:
            group = dist.new_group([ranks[src], ranks[dst]])
            if rank in (ranks[src], ranks[dst]):
                mine[src, dst, kind] = group
    return mine


def pair_group(topology: Topology, rank: int, a: int, b: int) -> dist.ProcessGroup | None:
    """This rank's two-rank group of stages `a` and `b` of its pipeline (the tied-weight
    exchange, `dsnd.pipeline.tied`), or None where this rank is neither. Every rank creates
    every pipeline's group."""
    mine = None
    for ranks in topology.groups("pipe"):
        group = dist.new_group(sorted({ranks[a], ranks[b]}))
        if rank in (ranks[a], ranks[b]):
            mine = group
    return mine
