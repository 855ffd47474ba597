"""Context parallelism (ring and Ulysses) in compositions with pipeline stages, tensor and
sequence parallelism, data parallelism and ZeRO 0-3 equals a plain single-process PyTorch run.

Real gloo ranks; same global batch (16 sequences of 64 tokens); losses, gradient norms and
learning rates within 1e-4 relative over five steps. Llama cases use grouped-query attention (4
heads, 2 key/value heads: at cp=2 Ulysses gives each rank 2 and 1); GPT-2 (4 and 4) carries the
Ulysses cases at cp=4 and under tensor parallelism, which leaves Llama one key/value head per
rank. A cp=2 checkpoint resumes on cp=1 and on Ulysses, its next steps equal to the
uninterrupted run.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.parity import (
    RTOL,
    assert_same,
    assert_same_as_references,
    case,
    run_cases,
)

RING2 = ("parallel.cp=2",)
ULYSSES2 = ("parallel.cp=2", "parallel.cp_impl=ulysses")


@pytest.mark.dist
def test_cp2_ring_and_ulysses_at_every_zero_stage(single, chat_sets, tmp_path):
    got = run_cases(
        tmp_path,
        2,
        [
            case("ring-cp2-z0", 0, sets=RING2),
            case("ulysses-cp2-z1", 1, sets=ULYSSES2),
            case("gpt2-ring-cp2-z2", 2, "gpt2-tiny", sets=RING2),
            case("gpt2-ulysses-cp2-z3", 3, "gpt2-tiny", sets=ULYSSES2),
            # chat data, assistant-only loss: each slice's share of the micro-batch's counted
            # labels,
            # weighed by the micro-batch's share of the global batch's
            case("chat-ring-cp2-z1", 1, sets=(*RING2, *chat_sets, "data.packing=stream")),
        ],
    )
    assert_same(got.pop("chat-ring-cp2-z1"), single["ref-chat-stream"], "chat-ring-cp2-z1")
    assert_same_as_references(got, single, skip=("resume",))


@pytest.mark.dist
def test_cp4_and_cp2_with_stages_tensors_or_replicas_and_resume(single, tmp_path):
    saved = os.path.join(tmp_path, "straight-ring-cp2-dp2-z1", "checkpoints", "step_00000003")
    resume = ("train.steps=5", f"checkpoint.resume={saved}")
    got = run_cases(
        tmp_path,
        4,
        [
            case("ring-cp4-z0", 0, sets=("parallel.cp=4",)),
            case(
                "gpt2-ulysses-cp4-z1",
                1,
                "gpt2-tiny",
                sets=("parallel.cp=4", "parallel.cp_impl=ulysses"),
            ),
            case("ring-cp2-pp2-z3", 3, sets=(*RING2, "parallel.pp=2")),
            # the split backward (input, then weight gradients): ring attention has no weights
            case(
                "ring-cp2-pp2-zb-h1-z1",
                1,
                sets=(*RING2, "parallel.pp=2", "parallel.schedule=zb-h1"),
            ),
            case(
                "ring-cp2-tp2-sp-z1",
                1,
                sets=(*RING2, "parallel.tp=2", "parallel.sequence_parallel=true"),
            ),
            case(
                "gpt2-ulysses-cp2-tp2-sp-z0",
                0,
                "gpt2-tiny",
                sets=(*ULYSSES2, "parallel.tp=2", "parallel.sequence_parallel=true"),
            ),
            # dp=2 x cp=2, ZeRO-1 over all four; its step-3 checkpoint resumed on cp=1 (dp=4) and
            # on Ulysses (dp=2 x cp=2)
            case("straight-ring-cp2-dp2-z1", 1, sets=(*RING2, "checkpoint.every=3")),
            case("resume-cp1-z1", 1, sets=resume),
            case("resume-ulysses-z1", 1, sets=(*ULYSSES2, *resume)),
        ],
    )
    assert_same_as_references(got, single, skip=("resume",))
    straight = got["straight-ring-cp2-dp2-z1"]
    for name in ("resume-cp1-z1", "resume-ulysses-z1"):
        rows = got[name]
        assert [r["step"] for r in rows] == [4, 5], name
        for row, want in zip(rows, straight[3:], strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert row[key] == pytest.approx(want[key], rel=RTOL), (name, row["step"], key)
