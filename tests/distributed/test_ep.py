"""Expert parallelism on 2 real gloo ranks (tests/distributed/ep_worker.py): each MoE family's
block with its experts split over the ranks gives every rank the whole block's output and input
gradient on its tokens, each rank's experts the gradient of every rank's tokens, and the router
(replicated) its tokens' share of the gradient; ranks hold different numbers of tokens."""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

RTOL = 1e-5  # of the reference's largest magnitude


@pytest.mark.dist
def test_split_experts_equal_the_whole_block(tmp_path):
    out = tmp_path / "out.json"
    run_ranks(2, ["tests/distributed/ep_worker.py", str(out)], timeout=120)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank, families in enumerate(ranks):
        assert sorted(families) == ["mixtral", "qwen2_moe", "qwen3_moe"]
        for family, found in families.items():
            assert found["local_experts"] == {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 4}[family]
            for key in ("out", "x_grad", "gate_up_proj", "down_proj", "router"):
                assert found[key] < RTOL, (rank, family, key, found[key])
            assert found["router_grad_max"] > 1e-3, (rank, family)
            # a rank holds its experts' slices of the (E, ., .) tensors, nothing of the others
            assert (
                found["gate_up_proj_held"] == found["down_proj_held"] == found["local_experts"]
            ), (rank, family)
