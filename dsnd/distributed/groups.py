"""Process groups, built once from the topology and passed explicitly (never module globals).

`torch.distributed.new_group` must be called by every rank for every group, in the same order,
so each axis's full list of groups is created everywhere and each rank keeps its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from dsnd.config.resolve import Resolved
from dsnd.topology import Coord, Topology

Channel = tuple[int, int, str]  # (from stage, to stage, "act" or "grad"): `pipe_channels`


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the topology and every group it belongs to (None: that degree is 1
    or that group is not needed)."""

    topology: Topology
    rank: int
    coord: Coord
    pipe: dist.ProcessGroup  # the stages of one pipeline (same dp, cp, tp)
    # every rank holding the same parameters as this one (same pp, tp; all dp x cp): gradients
    # are averaged over it and the loss is (context-parallel peers computed parts of the same
    # sequences' gradients, so they reduce together, as Megatron does)
    data: dist.ProcessGroup
    tensor: dist.ProcessGroup  # the tensor-parallel peers of this rank (same pp, dp, cp)
    context: dist.ProcessGroup  # the ranks holding slices of the same sequences (same pp, dp, tp)
    replica: dist.ProcessGroup  # one full model replica: every pp x tp rank of this dp, cp
    # what ZeRO shards over: `data`, or with parallel.dp_shard this rank's run of dp_shard
    # ranks of it, and the replicas across those runs (`dsnd.engine.hsdp`)
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None = None
    # parallel.ep > 1: the ranks splitting the MoE layers' experts, and those holding the same
    # experts (over which ZeRO shards and averages them)
    expert: dist.ProcessGroup | None = None
    expert_data: dist.ProcessGroup | None = None
    hpz: dist.ProcessGroup | None = None  # ZeRO++ hpZ: ZeRO-3's secondary partition
    channels: dict[Channel, dist.ProcessGroup] = field(default_factory=dict)  # `channel_groups`
    pairs: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)  # tied weights

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.topology.pp - 1

    def for_zero(self) -> ProcessGroups:
        """These groups as ZeRO sees them: `data` cut to the shard group (the same groups
        without hybrid sharding)."""
        return self if self.shard is self.data else replace(self, data=self.shard)


def _own_group(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in no group of {groups}"
    return mine


def build_groups(
    topology: Topology, ring: bool = False, ties: Sequence[tuple[int, int]] = ()
) -> ProcessGroups:
    """Create every group of `topology`, once, in the same order on every rank (as
    `torch.distributed.new_group` requires); needs an initialised default process group. `ring`
    and `ties` are what the run's pipeline needs besides its neighbours: the last stage to the
    first (interleaved schedules) and the stage pairs sharing a tied weight."""
    rank = dist.get_rank()
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != topology {topology}")
    t = topology
    data = _own_group(t.zero_groups(), rank)
    return ProcessGroups(
        topology=t,
        rank=rank,
        coord=t.coord(rank),
        pipe=_own_group(t.groups("pipe"), rank),
        data=data,
        tensor=_own_group(t.groups("model"), rank),
        context=_own_group(t.groups("context"), rank),
        replica=_own_group(t.model_parallel_groups(), rank),
        shard=_own_group(t.shard_groups(), rank) if t.dp_shard else data,
        replicate=_own_group(t.replicate_groups(), rank) if t.dp_shard else None,
        expert=_own_group(t.expert_groups(), rank) if t.ep > 1 else None,
        expert_data=_own_group(t.expert_data_groups(), rank) if t.ep > 1 else None,
        hpz=_own_group(t.runs_of(t.hpz), rank) if t.hpz > 1 else None,
        channels=channel_groups(t, rank, ring),
        pairs={(a, b): _pair_group(t, rank, a, b) for a, b in sorted(set(ties))},
    )


def run_groups(*runs: Resolved) -> ProcessGroups:
    """Every group runs of one topology need (their plans' pipeline channels and tied pairs
    too): one run's, or those of several runs that share the groups (`dsnd bench`)."""
    topology = runs[0].topology
    if any(res.topology != topology for res in runs):
        raise ValueError(f"runs of different topologies share no groups: {runs}")
    ties = [(tie.owner, tie.borrower) for res in runs for tie in res.plan.ties]
    return build_groups(topology, ring=any(res.plan.chunks > 1 for res in runs), ties=ties)


def pipe_channels(stages: int, ring: bool) -> list[tuple[int, int, str]]:
    """Every one-way message channel of a pipeline of `stages` stages, as (from stage, to stage,
    kind): activations forward and gradients back between neighbours, and with `ring`
    (interleaved schedules: the last stage's chunk c feeds the first stage's chunk c + 1) the
    same between the last stage and the first."""
    pairs = [(s, s + 1) for s in range(stages - 1)]
    if ring and stages > 1:
        pairs.append((stages - 1, 0))
    return [ch for a, b in pairs for ch in ((a, b, "act"), (b, a, "grad"))]


def channel_groups(
    topology: Topology, rank: int, ring: bool
) -> dict[tuple[int, int, str], dist.ProcessGroup]:
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


def _pair_group(topology: Topology, rank: int, a: int, b: int) -> dist.ProcessGroup | None:
    """This rank's two-rank group of stages `a` and `b` of its pipeline (the tied-weight
    exchange, `dsnd.pipeline.tied`), or None where this rank is neither. Every rank creates
    every pipeline's group."""
    mine = None
    for ranks in topology.groups("pipe"):
        group = dist.new_group(sorted({ranks[a], ranks[b]}))
        if rank in (ranks[a], ranks[b]):
            mine = group
    return mine
