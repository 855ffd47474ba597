"""The elastic layout rule (dsnd/config/elastic.py): the same global batch on every world, the
run's own degrees kept where they divide it, the rest chosen by model-state bytes, refusals in one
line."""

from __future__ import annotations

import pytest

from dsnd.config.elastic import Degrees, candidates, changes, choose, resolve_world
from dsnd.config.load import load
from dsnd.errors import UserError

BASE = ["elastic.enabled=true", "ds.train_batch_size=12", "ds.train_micro_batch_size_per_gpu=2"]


def test_candidates_keep_what_divides_and_shrink_the_rest():
    want = Degrees(pp=2, tp=1, cp=1, ep=4, dp_shard=4, micro=4)
    got = candidates(want, world=4, train=12, layers=4)
    by_pp = {(d.pp, d.tp, d.cp): d for d in got}
    # dp 2: ep and dp_shard shrink to 2; 12 / 2 = 6 sequences per dp rank: micro 4 -> 3
    assert by_pp[(2, 1, 1)] == Degrees(2, 1, 1, 2, 2, 3)
    # dp 4 does not divide... 12 / 4 = 3 per rank: micro 3; ep and dp_shard kept
    assert by_pp[(1, 1, 1)] == Degrees(1, 1, 1, 4, 4, 3)
    assert changes(want, by_pp[(2, 1, 1)]) == ["ep 4->2", "dp_shard 4->2", "micro 4->3"]
    # dp must divide the global batch: 12 / 8 does not, so world 8 has no pp=1 layout
    assert all(d.pp * d.tp * d.cp != 1 for d in candidates(want, 8, 12, 4))
    # pp never past the model's layers
    assert max(d.pp for d in candidates(want, 8, 12, 4)) == 4


def test_the_global_batch_is_kept_and_accumulation_follows():
    loaded = load(None, [*BASE, "parallel.pp=2"])
    six, line6 = resolve_world(loaded, 6)
    four, line4 = resolve_world(loaded, 4)
    assert (six.topology.pp, six.topology.dp, six.batch) == (2, 3, (12, 2, 2))
    assert (four.topology.pp, four.topology.dp, four.batch) == (2, 2, (12, 2, 3))
    assert "changed of the run config: nothing" in line6 and "dp 2" in line4
    # the learning rate is the JSON's on both (nothing rescaled by dp)
    assert six.ds["optimizer"]["params"]["lr"] == four.ds["optimizer"]["params"]["lr"]


def test_a_degree_that_no_longer_divides_changes_to_the_least_memory():
    choice = choose(load(None, [*BASE, "parallel.pp=2"]), 3)
    t = choice.res.topology
    assert choice.changed == [f"pp 2->{t.pp}"]
    assert t.pp * t.dp == 3
    # ZeRO-0: a stage's whole states on every rank, so more stages hold less each
    assert t.pp == 3


def test_refusals_name_the_key_and_the_numbers():
    with pytest.raises(UserError, match="train_batch_size as a number"):
        choose(load(None, ["elastic.enabled=true", "ds.train_batch_size=auto"]), 2)
    with pytest.raises(UserError) as e:
        choose(load(None, [*BASE, "elastic.memory_gb=1e-9"]), 4)
    assert "no layout of 4 ranks" in str(e.value) and "elastic.memory_gb" in str(e.value)
    assert "\n" not in str(e.value)


def test_not_elastic_is_plain_resolve():
    res, line = resolve_world(load(None, ["parallel.pp=2"]), 4)
    assert line is None and res.batch == (16, 2, 4)
    with pytest.raises(UserError, match="divide"):
        resolve_world(load(None, ["parallel.pp=2", "ds.train_batch_size=12"]), 8)


def test_the_json_accumulation_steps_that_change_are_named():
    sets = [*BASE, "parallel.pp=2", "ds.gradient_accumulation_steps=2"]
    assert choose(load(None, sets), 6).changed == []  # 12 = 2 x 2 x dp 3: as written
    assert choose(load(None, sets), 4).changed == ["gradient_accumulation_steps 2->3"]
