"""Pure rank math for the (pipe, data, context, model) axes; no torch.distributed here.

Ranks are laid out as in DeepSpeed's `PipeModelDataParallelTopology` (axes ``pipe, data, model``,
the last varying fastest) with Megatron's context axis between data and model, so
tensor-parallel peers are neighbouring ranks (same host, fastest links), context-parallel peers
(which exchange keys and values every layer) come next, and pipeline stages are the outermost
blocks::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

`Topology.groups(axis)` lists the rank groups along one axis — the ranks that differ only in that
coordinate; `Topology.groups_across(axes)` those that differ only in several (ZeRO's group is
data x context: every rank that holds the same parameters). `dist.groups` turns exactly these
lists into process groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from dsnd.errors import UserError
from dsnd.topology_rules import check_degrees

AXES = ("pipe", "data", "context", "model")


class Coord(NamedTuple):
    """A rank's position: pipeline stage, data-parallel index, tensor-parallel index and
    context-parallel index (last, so a layout without context parallelism reads as before)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Topology:
    """A world of ``pp * dp * cp * tp`` ranks, and the degrees carved out of its data axis: `ep`
    (expert parallelism: runs of ep consecutive data indices split each MoE layer's experts),
    `dp_shard` (hybrid sharding: ZeRO-3 within runs of dp_shard ranks, replicated across them;
    0 = over all of dp) and `hpz` (ZeRO++ hpZ: ZeRO-3's secondary parameter partition over runs
    of hpz ranks; 1 = none). Every rule about degrees is checked when one is built, with the
    message the user gets; `hpz_from` names the DeepSpeed JSON the hpZ size came from."""

    pp: int
    dp: int
    tp: int
    cp: int = 1
    ep: int = 1
    dp_shard: int = 0
    hpz: int = 1
    hpz_from: str = field(default="the DeepSpeed JSON", compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "cp", "hpz"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == self.dp:  # sharding over all of dp is plain ZeRO-3
            object.__setattr__(self, "dp_shard", 0)
        check_degrees(self)

    @classmethod
    def from_world(cls, world_size: int, pp: int, tp: int, cp: int = 1, **degrees) -> Topology:
        """The topology whose data-parallel size fills `world_size` ranks (`degrees`: ep,
        dp_shard, hpz, hpz_from)."""
        if pp < 1 or tp < 1:
            raise UserError(f"parallel.pp and parallel.tp must be >= 1, got pp={pp} tp={tp}")
        if cp < 1:
            raise UserError(f"parallel.cp must be >= 1, got {cp}")
        if world_size % (pp * tp * cp):
            names = "parallel.pp * parallel.tp" + " * parallel.cp" * (cp > 1)
            sizes = f"{pp} * {tp}" + f" * {cp}" * (cp > 1)
            raise UserError(
                f"world size {world_size} is not divisible by {names} = {sizes} = {pp * tp * cp}"
            )
        return cls(pp=pp, dp=world_size // (pp * tp * cp), tp=tp, cp=cp, **degrees)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def _sizes(self) -> dict[str, int]:
        return {"pipe": self.pp, "data": self.dp, "context": self.cp, "model": self.tp}

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coord(pp, dp, tp, cp)

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def _rank_at(self, c: dict[str, int]) -> int:
        return self.rank(c["pipe"], c["data"], c["model"], c["context"])

    def groups_across(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Rank lists that differ only in `axes` (each list ordered by rank), in a deterministic
        order."""
        unknown = [a for a in axes if a not in AXES]
        if unknown or not axes:
            raise ValueError(f"unknown axes {unknown or axes!r}; expected some of {AXES}")
        sizes = self._sizes()
        fixed_axes = [a for a in AXES if a not in axes]
        out = []
        for fixed in itertools.product(*(range(sizes[a]) for a in fixed_axes)):
            ranks = [
                self._rank_at(
                    dict(zip(fixed_axes, fixed, strict=True)) | dict(zip(axes, varied, strict=True))
                )
                for varied in itertools.product(*(range(sizes[a]) for a in axes))
            ]
            out.append(sorted(ranks))
        return out

    def groups(self, axis: str) -> list[list[int]]:
        """Rank lists along `axis` ("pipe", "data", "context" or "model")."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        return self.groups_across((axis,))

    def zero_groups(self) -> list[list[int]]:
        """The ranks of a stage that hold the same parameters (data x context): what ZeRO
        shards over and averages gradients over."""
        return self.groups_across(("data", "context"))

    def expert_groups(self) -> list[list[int]]:
        """Expert-parallel groups: each data-parallel group cut into runs of `ep` consecutive
        data indices. Its ranks hold different experts of every MoE layer and exchange tokens
        (all-to-all); they see the same weights otherwise."""
        ep = self.ep
        return [g[i : i + ep] for g in self.groups("data") for i in range(0, len(g), ep)]

    def expert_data_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups ((dp / ep) x cp ranks each): the ranks of a stage's ZeRO
        group (data x context) at the same place of their expert-parallel groups, which hold
        the same experts; what the experts' gradients are averaged over and their ZeRO shards
        split over (context-parallel peers computed parts of the same sequences)."""
        return [
            [r for r in ranks if self.coord(r).dp % self.ep == j]
            for ranks in self.zero_groups()
            for j in range(self.ep)
        ]

    def runs_of(self, size: int) -> list[list[int]]:
        """Every stage's ZeRO group cut into runs of `size` consecutive ranks (so with a host's
        ranks in a row a run stays inside a host)."""
        return [
            ranks[i : i + size] for ranks in self.zero_groups() for i in range(0, len(ranks), size)
        ]

    def shard_groups(self) -> list[list[int]]:
        """Hybrid sharding's shard groups (runs of `dp_shard` ranks: what ZeRO-3 partitions
        over); the ZeRO groups themselves without hybrid sharding."""
        return self.runs_of(self.dp_shard) if self.dp_shard else self.zero_groups()

    def replicate_groups(self) -> list[list[int]]:
        """Hybrid sharding's replica groups: the ranks at the same place of a stage's shard
        groups, over which gradients are averaged (empty without hybrid sharding)."""
        size = self.dp_shard
        return [ranks[i::size] for ranks in self.zero_groups() for i in range(size)] if size else []

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except `axis`."""
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group per axis")

    def model_parallel_groups(self) -> list[list[int]]:
        """Ranks that hold one full model replica (all pipe x model coordinates of one data and
        context index).

        DeepSpeed's mpu calls this the model-parallel group: gradient norms of replicated
        parameters are summed over it.
        """
        return self.groups_across(("pipe", "model"))
