"""Topology rank math against golden tables and DeepSpeed's PipeModelDataParallelTopology."""

from __future__ import annotations

import importlib

import pytest

from dsnd.errors import UserError
from dsnd.topology import Coord, Topology

LAYOUTS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 2), (1, 4, 2)]

# rank -> (pp, dp, tp): tensor-parallel peers adjacent, pipeline stages outermost.
GOLDEN_COORDS = {
    (2, 2, 2): [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ],
    (4, 1, 2): [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
        (2, 0, 0),
        (2, 0, 1),
        (3, 0, 0),
        (3, 0, 1),
    ],
    (1, 4, 2): [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (0, 2, 0),
        (0, 2, 1),
        (0, 3, 0),
        (0, 3, 1),
    ],
    (2, 2, 1): [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)],
}

GOLDEN_GROUPS = {
    (2, 2, 2): {
        "pipe": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "model": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (4, 1, 2): {
        "pipe": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "data": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "model": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (1, 4, 2): {
        "pipe": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "data": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "model": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (2, 2, 1): {
        "pipe": [[0, 2], [1, 3]],
        "data": [[0, 1], [2, 3]],
        "model": [[0], [1], [2], [3]],
    },
}


@pytest.mark.parametrize("layout", sorted(GOLDEN_COORDS))
def test_coords_golden(layout):
    topo = Topology(*layout)
    assert [tuple(topo.coord(r))[:3] for r in range(topo.world_size)] == GOLDEN_COORDS[layout]
    for rank, c in enumerate(GOLDEN_COORDS[layout]):
        assert topo.rank(*c) == rank
        assert topo.coord(rank) == Coord(*c)


@pytest.mark.parametrize("layout", sorted(GOLDEN_GROUPS))
def test_groups_golden(layout):
    topo = Topology(*layout)
    for axis, groups in GOLDEN_GROUPS[layout].items():
        assert topo.groups(axis) == groups, axis
        for group in groups:
            for rank in group:
                assert topo.group_of(rank, axis) == group


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_partition_world_and_vary_one_axis(layout):
    topo = Topology(*layout)
    sizes = {"pipe": topo.pp, "data": topo.dp, "model": topo.tp}
    fields = {"pipe": "pp", "data": "dp", "model": "tp"}
    for axis in ("pipe", "data", "model"):
        groups = topo.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        for group in groups:
            assert len(group) == sizes[axis]
            coords = [topo.coord(r) for r in group]
            assert [getattr(c, fields[axis]) for c in coords] == list(range(sizes[axis]))
            for other in set(fields) - {axis}:
                assert len({getattr(c, fields[other]) for c in coords}) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_equal_deepspeed(layout):
    ds_topology = importlib.import_module("deepspeed.runtime.pipe.topology")
    pp, dp, tp = layout
    theirs = ds_topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    topo = Topology(pp, dp, tp)
    for axis in ("pipe", "data", "model"):
        assert topo.groups(axis) == theirs.get_axis_comm_lists(axis), axis
    for rank in range(topo.world_size):
        c = theirs.get_coord(rank)
        assert topo.coord(rank) == Coord(c.pipe, c.data, c.model)


def test_model_parallel_groups_hold_one_replica():
    assert Topology(2, 2, 2).model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert Topology(1, 4, 1).model_parallel_groups() == [[0], [1], [2], [3]]


def test_from_world_and_errors():
    assert Topology.from_world(8, pp=2, tp=2) == Topology(2, 2, 2)
    with pytest.raises(UserError, match=r"world size 6 is not divisible .* = 4"):
        Topology.from_world(6, pp=2, tp=2)
    with pytest.raises(UserError, match="parallel.dp must be >= 1, got 0"):
        Topology(1, 0, 1)
    with pytest.raises(ValueError, match="rank 8 outside world of 8"):
        Topology(2, 2, 2).coord(8)
    with pytest.raises(ValueError, match="unknown axis"):
        Topology(1, 1, 1).groups("tensor")


def test_context_axis_sits_between_data_and_model():
    """rank = ((pp*dp + d)*cp + c)*tp + t: tensor peers adjacent, context peers next."""
    topo = Topology(pp=2, dp=1, tp=2, cp=2)
    assert [tuple(topo.coord(r)) for r in range(8)] == [
        (0, 0, 0, 0),
        (0, 0, 1, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 1),
        (1, 0, 0, 0),
        (1, 0, 1, 0),
        (1, 0, 0, 1),
        (1, 0, 1, 1),
    ]
    assert topo.groups("context") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ZeRO's group: every rank of a stage holding the same tensor shard (data x context)
    assert topo.groups_across(("data", "context")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    wide = Topology(pp=1, dp=2, tp=1, cp=2)
    assert wide.groups("data") == [[0, 2], [1, 3]]
    assert wide.groups("context") == [[0, 1], [2, 3]]
    assert wide.groups_across(("data", "context")) == [[0, 1, 2, 3]]
    for rank in range(8):
        assert topo.rank(*topo.coord(rank)) == rank
    assert Topology.from_world(8, pp=2, tp=1, cp=2) == Topology(2, 2, 1, 2)
    with pytest.raises(
        UserError, match=r"parallel.pp \* parallel.tp \* parallel.cp = 2 \* 1 \* 4 = 8"
    ):
        Topology.from_world(12, pp=2, tp=1, cp=4)


def test_expert_groups_are_carved_out_of_data_parallel():
    """pp=2 x dp=4 x tp=1, ep=2: each stage's data group [0..3] / [4..7] splits into runs of
    two (the ranks that exchange tokens) and the ranks at the same place of each run (which
    hold the same experts)."""
    topo = Topology(pp=2, dp=4, tp=1, ep=2)
    assert topo.expert_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.expert_data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert Topology(pp=2, dp=4, tp=1, ep=4).expert_groups() == topo.groups("data")
    assert Topology(pp=2, dp=4, tp=1).expert_data_groups() == topo.groups("data")
    with_tp = Topology(pp=1, dp=2, tp=2, ep=2)  # tensor-parallel peers are neighbours: 0,1 | 2,3
    assert with_tp.expert_groups() == [[0, 2], [1, 3]]
    # with context parallelism the experts' ZeRO group takes the context-parallel peers too
    with_cp = Topology(pp=1, dp=2, tp=1, cp=2, ep=2)
    ep_groups, edp = with_cp.expert_groups(), with_cp.expert_data_groups()
    assert all({with_cp.coord(r).cp for r in g} == {with_cp.coord(g[0]).cp} for g in ep_groups)
    assert sorted(len(g) for g in edp) == [2, 2]
    assert all({with_cp.coord(r).dp for r in g} == {with_cp.coord(g[0]).dp} for g in edp)
    assert sorted(r for g in edp for r in g) == [0, 1, 2, 3]
    with pytest.raises(UserError, match=r"parallel.ep=3 must divide the data-parallel size dp=4"):
        Topology(pp=2, dp=4, tp=1, ep=3)


def test_hybrid_sharding_and_hpz_groups_are_runs_of_each_stages_zero_group():
    """dp_shard=2 at pp=2 x dp=4: ZeRO-3 shards over runs of two consecutive ranks of each
    stage's data group and gradients are averaged across the runs; hpZ's secondary partition
    is cut the same way. dp_shard = dp is plain ZeRO-3 (no groups of its own)."""
    hsdp = Topology(pp=2, dp=4, tp=1, dp_shard=2)
    assert hsdp.shard_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hsdp.replicate_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    plain = Topology(pp=2, dp=4, tp=1, dp_shard=4)
    assert plain == Topology(pp=2, dp=4, tp=1) and plain.dp_shard == 0
    assert plain.shard_groups() == plain.zero_groups() and plain.replicate_groups() == []
    assert Topology(pp=2, dp=4, tp=1, hpz=2).runs_of(2) == hsdp.shard_groups()


@pytest.mark.parametrize(
    "degrees, message",
    [
        ({"dp": 4, "ep": 0}, "parallel.ep=0 must be >= 1"),
        (
            {"dp": 4, "dp_shard": 3},
            "parallel.dp_shard=3 must divide the data-parallel size dp=4 "
            "(or be null or 0: shard over all of dp)",
        ),
        ({"dp": 4, "dp_shard": -2}, "parallel.dp_shard=-2 must divide"),
        (
            {"dp": 4, "hpz": 3, "hpz_from": "z3.json"},
            "z3.json: zero_optimization.zero_hpz_partition_size=3 must divide each stage's "
            "data-parallel size dp=4",
        ),
        (
            {"dp": 4, "dp_shard": 2, "hpz": 2, "hpz_from": "z3.json"},
            "z3.json: zero_optimization.zero_hpz_partition_size=2 and parallel.dp_shard=2 both "
            "choose where ZeRO-3 gathers parameters from; set one of them",
        ),
        (
            {"dp": 4, "cp": 2, "dp_shard": 2},
            "parallel.dp_shard=2 with parallel.cp=2 is not supported",
        ),
        (
            {"dp": 4, "ep": 2, "dp_shard": 2},
            "parallel.ep=2 with parallel.dp_shard=2 is not supported",
        ),
        (
            {"dp": 4, "ep": 2, "hpz": 2, "hpz_from": "z3.json"},
            "z3.json: zero_optimization."
            "zero_hpz_partition_size=2 with parallel.ep=2 is not supported",
        ),
    ],
)
def test_every_rule_about_degrees_is_checked_when_a_topology_is_built(degrees, message):
    with pytest.raises(UserError) as e:
        Topology(pp=1, tp=1, **degrees)
    assert message in str(e.value)
