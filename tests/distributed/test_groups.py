"""dsnd's process groups and mpu on 4 real gloo ranks, against golden rank tables and against
DeepSpeed's own `PipelineParallelGrid` built from the same topology.

One set of ranks (tests/distributed/groups_worker.py) checks every (pp, tp) layout of the world.
"""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

WORLD = 4

# (pp, tp) -> the rank groups along each axis (rank = pp_index * dp * tp + dp_index * tp + tp_index)
# "model" is one full replica: every pipe x tensor rank of one data-parallel index.
GOLDEN = {
    (1, 1): {
        "data": [[0, 1, 2, 3]],
        "tensor": [[0], [1], [2], [3]],
        "pipe": [[0], [1], [2], [3]],
        "model": [[0], [1], [2], [3]],
    },
    (2, 1): {
        "data": [[0, 1], [2, 3]],
        "tensor": [[0], [1], [2], [3]],
        "pipe": [[0, 2], [1, 3]],
        "model": [[0, 2], [1, 3]],
    },
    (1, 2): {
        "data": [[0, 2], [1, 3]],
        "tensor": [[0, 1], [2, 3]],
        "pipe": [[0], [1], [2], [3]],
        "model": [[0, 1], [2, 3]],
    },
    (2, 2): {
        "data": [[0], [1], [2], [3]],
        "tensor": [[0, 1], [2, 3]],
        "pipe": [[0, 2], [1, 3]],
        "model": [[0, 1, 2, 3]],
    },
    (4, 1): {
        "data": [[0], [1], [2], [3]],
        "tensor": [[0], [1], [2], [3]],
        "pipe": [[0, 1, 2, 3]],
        "model": [[0, 1, 2, 3]],
    },
    (1, 4): {
        "data": [[0], [1], [2], [3]],
        "tensor": [[0, 1, 2, 3]],
        "pipe": [[0], [1], [2], [3]],
        "model": [[0, 1, 2, 3]],
    },
}

LAYOUTS = list(GOLDEN)
IDS = [f"pp{pp}-tp{tp}" for pp, tp in LAYOUTS]


def group_of(layout: tuple[int, int], axis: str, rank: int) -> list[int]:
    (group,) = [g for g in GOLDEN[layout][axis] if rank in g]
    return group


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("groups") / "out.json"
    run_ranks(WORLD, ["tests/distributed/groups_worker.py", str(out)], timeout=120)
    raw = json.loads(out.read_text())
    found = {
        tuple(int(x) for x in key.split(",")): rows for key, rows in raw.items() if key != "degrees"
    }
    found["degrees"] = raw["degrees"]
    return found


@pytest.mark.dist
def test_build_groups_makes_the_group_of_every_degree(found):
    """ep=2, dp_shard=2 and hpz=2 at dp=4 (runs of two consecutive ranks, and the ranks at the
    same place of each run), none where a degree is 1, and a pp=2 x dp=2 pipeline's four
    channels (the ring's two included) and one group for its tied pair, asked for twice."""
    rows = found["degrees"]
    run, same_place = [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["expert"] for r in rows] == run
    assert [r["expert_data"] for r in rows] == same_place
    assert [r["shard"] for r in rows] == run and [r["zero_data"] for r in rows] == run
    assert [r["replicate"] for r in rows] == same_place
    assert [r["data"] for r in rows] == [[0, 1, 2, 3]] * 4
    assert [r["hpz"] for r in rows] == run
    assert all(r["no_hpz"] is None and r["ep_replicate"] is None for r in rows)
    assert [r["ep_shard"] for r in rows] == [[0, 1, 2, 3]] * 4
    pipes = [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r, pipe in zip(rows, pipes, strict=True):
        assert r["channels"] == {k: pipe for k in ("01act", "10grad", "10act", "01grad")}
        assert r["pairs"] == {"01": pipe}


@pytest.mark.dist
def test_every_layout_reported_by_every_rank(found):
    assert sorted(k for k in found if k != "degrees") == sorted(LAYOUTS)
    for layout, rows in ((k, v) for k, v in found.items() if k != "degrees"):
        assert [row["rank"] for row in rows] == list(range(WORLD)), layout


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_dsnd_groups_match_golden_tables(found, layout):
    for rank, row in enumerate(found[layout]):
        want = {axis: group_of(layout, axis, rank) for axis in ("data", "tensor", "pipe", "model")}
        got = row["dsnd"]
        assert {axis: got[axis] for axis in want} == want, (layout, rank)
        # the mpu hands DeepSpeed exactly these groups
        assert got["mpu_data"] == want["data"], (layout, rank)
        assert got["mpu_model"] == want["model"], (layout, rank)
        assert got["mpu_pipe"] == want["pipe"], (layout, rank)


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_dsnd_groups_equal_deepspeed_grid_groups(found, layout):
    for rank, row in enumerate(found[layout]):
        dsnd, grid = row["dsnd"], row["grid"]
        assert dsnd["data"] == grid["data"] == grid["data_list"], (layout, rank)
        assert dsnd["tensor"] == grid["slice"], (layout, rank)
        assert dsnd["pipe"] == grid["pipe"], (layout, rank)
        # the grid's "model parallel" group is a whole replica (pipe x tensor), dsnd's `model`
        assert dsnd["model"] == grid["model"], (layout, rank)


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_mpu_answers_match_grid_and_groups(found, layout):
    pp, tp = layout
    dp = WORLD // (pp * tp)
    for rank, row in enumerate(found[layout]):
        mpu, grid = row["mpu_answers"], row["grid_answers"]
        data, tensor, pipe = (group_of(layout, a, rank) for a in ("data", "tensor", "pipe"))
        # (pp, dp, tp, cp): no context parallelism in these layouts
        assert row["coord"] == [pipe.index(rank), data.index(rank), tensor.index(rank), 0]
        assert (mpu["data_rank"], mpu["data_size"]) == (data.index(rank), dp), (layout, rank)
        assert (mpu["model_rank"], mpu["model_size"]) == (tensor.index(rank), pp * tp), (
            layout,
            rank,
        )
        assert (mpu["tensor_rank"], mpu["tensor_size"]) == (tensor.index(rank), tp)
        assert mpu["tensor_src"] == tensor[0], (layout, rank)
        assert (mpu["pipe_rank"], mpu["pipe_size"]) == (pipe.index(rank), pp), (layout, rank)

        assert (mpu["data_rank"], mpu["data_size"]) == (grid["data_rank"], grid["data_size"])
        assert (mpu["pipe_rank"], mpu["pipe_size"]) == (grid["pipe_rank"], grid["pipe_size"])
        # the norm's model-parallel rank is the tensor rank, which the grid calls "slice"
        assert mpu["model_rank"] == grid["slice_rank"]
        assert mpu["model_size"] == grid["model_size"]


@pytest.mark.dist
@pytest.mark.parametrize("layout", [(2, 1), (2, 2), (4, 1)], ids=["pp2-tp1", "pp2-tp2", "pp4-tp1"])
def test_model_parallel_rank_is_the_tensor_rank_not_the_replica_rank(found, layout):
    """With pp > 1 DeepSpeed's grid answers get_model_parallel_rank over pipe x tensor.

    dsnd runs one DeepSpeedEngine per stage and passes its mpu to it; DeepSpeed's gradient-norm
    code counts a replicated parameter only where the model-parallel rank is 0, so the grid's
    rank would drop every stage's gradients but the first. dsnd's mpu sums norms over the whole
    replica but answers the tensor rank (see dsnd/distributed/mpu.py)."""
    pp, tp = layout
    for rank, row in enumerate(found[layout]):
        replica = group_of(layout, "model", rank)
        tensor = group_of(layout, "tensor", rank)
        grid = row["grid_answers"]
        assert (grid["model_rank"], grid["model_size"]) == (replica.index(rank), pp * tp)
        assert row["mpu_answers"]["model_rank"] == tensor.index(rank)
        assert row["dsnd"]["mpu_model"] == replica


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_all_reduce_over_dsnd_data_group_sums_its_members(found, layout):
    for rank, row in enumerate(found[layout]):
        assert row["data_sum"] == sum(group_of(layout, "data", rank)), (layout, rank)
