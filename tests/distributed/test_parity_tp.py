"""Tensor parallelism (Megatron-style, each family's TP plan) in every composition with
pipeline stages, ZeRO 0-3 and data parallelism equals a plain single-process PyTorch run.

Real gloo ranks; same global batch (16); losses, gradient norms (replicated parameters counted
once across tensor-parallel ranks) and learning rates within 1e-4 relative over five steps. The
Llama cases use grouped-query attention (4 heads, 2 key/value heads: one of each per rank at
tp=2); the GPT-2 cases a fused q|k|v split with stride 3 and an embedding tied to the head.
pp=2 x tp=2 x dp=2 (eight ranks) runs in test_parity_families.py, beside Qwen2.5 on the same
ranks.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_same_as_references, case, run_cases

TP2 = ("parallel.tp=2",)
PP2_TP2 = ("parallel.pp=2", "parallel.tp=2")
SP = ("parallel.sequence_parallel=true",)


@pytest.mark.dist
def test_tp2_zero_0_to_3_with_and_without_sequence_parallel(single, tmp_path):
    got = run_cases(
        tmp_path,
        2,
        [
            case("tp2-z0", 0, sets=TP2),
            case("tp2-z1", 1, sets=TP2),
            case("tp2-sp-z3", 3, sets=(*TP2, *SP)),
            case("gpt2-tp2-z0", 0, "gpt2-tiny", sets=TP2),
            case("gpt2-tp2-sp-z2", 2, "gpt2-tiny", sets=(*TP2, *SP)),
        ],
    )
    assert_same_as_references(got, single)


@pytest.mark.dist
def test_tp2_with_two_stages_or_two_replicas(single, tmp_path):
    got = run_cases(
        tmp_path,
        4,
        [
            case("tp2-pp2-z1", 1, sets=PP2_TP2),
            case("tp2-pp2-z3", 3, sets=PP2_TP2),
            case(
                "tp2-pp2-sp-ckpt1-z0",
                0,
                sets=(*PP2_TP2, *SP, "parallel.activation_checkpoint_interval=1"),
            ),
            case("tp2-dp2-z3", 3, sets=TP2),
            case("gpt2-tp2-pp2-z3", 3, "gpt2-tiny", sets=PP2_TP2),  # tie across stages, split
        ],
    )
    assert_same_as_references(got, single)
