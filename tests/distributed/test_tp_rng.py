"""`dsnd.tp.random.TPRandomState` on 4 real gloo ranks, pp=1 x dp=2 x tp=2
(tests/distributed/rng_worker.py).

Outside `fork()` every rank of the stage draws the same dropout masks; inside it the masks differ
between tp ranks, agree between data-parallel replicas of one tp rank, and are reproducible from
the seed and from `state_dict()`; a fork leaves the default stream's sequence unchanged.
"""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

SEED = 1234


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rng") / "out.json"
    run_ranks(4, ["tests/distributed/rng_worker.py", str(out)], timeout=120)
    found = json.loads(out.read_text())
    # (pp, dp, tp, cp)
    assert [r["coord"] for r in found] == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0]]
    return found


def by_tp(ranks: list[dict], tp: int) -> list[dict]:
    return [r for r in ranks if r["coord"][2] == tp]


@pytest.mark.dist
def test_seeds_follow_megatron(ranks):
    for r in ranks:
        pp, _, tp, _ = r["coord"]
        assert r["seeds"] == [SEED + 100 * pp, SEED + 100 * pp + 2718 + tp]


@pytest.mark.dist
def test_masks_outside_fork_are_identical_on_every_rank_of_the_stage(ranks):
    for key in ("outside_a", "outside_b", "next_outside"):
        assert len({r[key] for r in ranks}) == 1, key
    # and they are real dropout masks, not all-kept or all-dropped
    assert 0 < ranks[0]["outside_a"].count("1") < len(ranks[0]["outside_a"])


@pytest.mark.dist
def test_masks_inside_fork_differ_between_tp_ranks_and_agree_across_replicas(ranks):
    for key in ("inside_1", "inside_2", "inside_3", "next_inside"):
        tp0, tp1 = ({r[key] for r in by_tp(ranks, t)} for t in (0, 1))
        assert len(tp0) == 1 and len(tp1) == 1, key  # dp replicas of a tp rank agree
        assert tp0 != tp1, key
        assert tp0 != {ranks[0]["outside_a"]}, key  # not the default stream either
    for r in ranks:
        assert len({r["inside_1"], r["inside_2"], r["inside_3"]}) == 3  # the stream advances


@pytest.mark.dist
def test_masks_inside_fork_are_reproducible_from_the_seed(ranks):
    for r in ranks:
        assert r["rerun_inside"] == [r["inside_1"], r["inside_2"], r["inside_3"]]


@pytest.mark.dist
def test_fork_does_not_disturb_the_default_stream(ranks):
    for r in ranks:
        assert r["outside_a"] == r["plain_a"]
        assert r["outside_b"] == r["plain_b"]
        assert r["after_error"] == r["after_error_expected"]  # restored after an exception


@pytest.mark.dist
def test_state_dict_round_trip_reproduces_the_next_masks(ranks):
    for r in ranks:
        assert r["restored_inside"] == r["next_inside"]
        assert r["restored_outside"] == r["next_outside"]
        assert r["other_inside"] == r["next_inside"]  # a tracker built with another seed
        assert r["other_outside"] == r["next_outside"]


@pytest.mark.dist
def test_forks_do_not_nest(ranks):
    for r in ranks:
        assert "do not nest" in r["nested"]
