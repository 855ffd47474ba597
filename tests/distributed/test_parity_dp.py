"""Data parallel x ZeRO 0-3 equals a plain single-process PyTorch run (fp32, 1e-4 relative).

Real gloo ranks, real DeepSpeed engines; same global batch (16) for every layout.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, assert_same, case, run_cases


@pytest.mark.dist
def test_single_rank_matches_plain_pytorch(single):
    assert_same(single["w1-z0"], single["ref-llama"], "llama z0 world 1")
    assert_same(single["w1-z3"], single["ref-llama"], "llama z3 world 1")
    assert_same(single["w1-gpt2-z0"], single["ref-gpt2"], "gpt2 z0 world 1")


@pytest.mark.dist
def test_trains_on_a_jsonl_corpus(single):
    rows = single["w1-jsonl"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # a repetitive corpus is learnt fast, and it is not the default corpus
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert rows[-1]["loss"] != pytest.approx(single["w1-z0"][-1]["loss"], rel=1e-3)


@pytest.mark.dist
def test_two_ranks_zero_0_to_3_match_single_process(single, tmp_path):
    got = run_cases(
        tmp_path,
        2,
        [
            case("w2-z0", 0),
            case("w2-z1", 1),
            case("w2-z2", 2),
            case("w2-z3", 3),
            case("w2-gpt2-z3", 3, "gpt2-tiny"),
        ],
    )
    for stage in range(4):
        assert_same(got[f"w2-z{stage}"], single["ref-llama"], f"llama z{stage} world 2")
    assert_same(got["w2-gpt2-z3"], single["ref-gpt2"], "gpt2 (tied) z3 world 2")
    # the run learns: loss falls over the five steps
    assert got["w2-z3"][-1]["loss"] < got["w2-z3"][0]["loss"]
