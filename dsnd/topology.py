"""Pure rank math for the (pipe, data, model) axes; no torch.distributed here.

Ranks are laid out as in DeepSpeed's `PipeModelDataParallelTopology` (axes ``pipe, data, model``,
the last varying fastest), so tensor-parallel peers are neighbouring ranks (same host, fastest
links) and pipeline stages are the outermost blocks::

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

`Topology.groups(axis)` lists the rank groups along one axis — the ranks that differ only in that
coordinate. `dist.groups` turns exactly these lists into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dsnd.errors import UserError

AXES = ("pipe", "data", "model")


class Coord(NamedTuple):
    """A rank's position: pipeline stage, data-parallel index, tensor-parallel index."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """A world of ``pp * dp * tp`` ranks."""

    pp: int
    dp: int
    tp: int

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_world(cls, world_size: int, pp: int, tp: int) -> Topology:
        """The topology whose data-parallel size fills `world_size` ranks."""
        if pp < 1 or tp < 1:
            raise UserError(f"parallel.pp and parallel.tp must be >= 1, got pp={pp} tp={tp}")
        if world_size % (pp * tp):
            raise UserError(
                f"world size {world_size} is not divisible by parallel.pp * parallel.tp = "
                f"{pp} * {tp} = {pp * tp}"
            )
        return cls(pp=pp, dp=world_size // (pp * tp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coord(pp, dp, tp)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Rank lists along `axis` ("pipe", "data" or "model"), in a deterministic order."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        sizes = {"pipe": self.pp, "data": self.dp, "model": self.tp}
        others = [a for a in AXES if a != axis]
        out = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                fixed = {others[0]: i, others[1]: j}
                ranks = []
                for k in range(sizes[axis]):
                    c = {**fixed, axis: k}
                    ranks.append(self.rank(c["pipe"], c["data"], c["model"]))
                out.append(ranks)
        return out

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except `axis`."""
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group per axis")

    def model_parallel_groups(self) -> list[list[int]]:
        """Ranks that hold one full model replica (all pipe x model coordinates of one dp index).

        DeepSpeed's mpu calls this the model-parallel group: gradient norms of replicated
        parameters are summed over it.
        """
        return [
            [self.rank(p, d, t) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
        ]

    def to_deepspeed(self):  # -> DeepSpeed's PipeModelDataParallelTopology
        """The equivalent DeepSpeed topology object (imports DeepSpeed lazily)."""
        from dsnd.engine.deepspeed_api import pipe_topology

        return pipe_topology(self.pp, self.tp, self.dp)
