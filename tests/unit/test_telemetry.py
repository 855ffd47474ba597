"""Telemetry's pure half: the expert-load tags an MoE run reports."""

from __future__ import annotations


def test_expert_load_tags_each_moe_layer_and_skips_dense_blocks():
    from dsnd.telemetry import expert_load

    tags, counts = expert_load([[0.0, 0.0, 0.0, 0.0], [8.0, 4.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]])
    assert counts == {"1": [8, 4, 2, 2], "2": [4, 4, 4, 4]}  # block 0 is dense
    assert tags == {
        "moe/layer1_load_max_over_mean": 2.0, "moe/layer1_load_min_over_mean": 0.5,
        "moe/layer2_load_max_over_mean": 1.0, "moe/layer2_load_min_over_mean": 1.0,
    }  # fmt: skip


def test_expert_parallel_runs_tag_the_share_of_rows_sent_off_rank():
    from dsnd.telemetry import expert_load

    load = [[0.0, 0.0], [6.0, 2.0], [4.0, 4.0]]
    tags, _ = expert_load(load, [0.0, 2.0, 6.0])
    assert tags["moe/layer1_sent_share"] == 0.25 and tags["moe/layer2_sent_share"] == 0.75
    assert "moe/layer0_sent_share" not in tags  # dense
    tags, _ = expert_load(load, [0.0, 0.0, 0.0])  # ep=1: nothing sent, no tag
    assert not any(t.endswith("sent_share") for t in tags)
