"""Pipeline stages (1F1B / GPipe) x ZeRO 0-3 equal a plain single-process PyTorch run.

Real gloo ranks, one DeepSpeed engine per stage sharded over the stage's data-parallel group, same
global batch (16) for every layout; losses, global gradient norms (over all stages) and learning
rates within 1e-4 relative.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_same, case, run_cases

PP2 = ("parallel.pp=2",)
CKPT = "parallel.activation_checkpoint_interval"


@pytest.mark.dist
def test_two_stages_one_replica_1f1b_and_gpipe(single, tmp_path):
    got = run_cases(
        tmp_path,
        2,
        [
            case("pp2-1f1b-z0", 0, sets=PP2),
            case("pp2-gpipe-z0", 0, sets=(*PP2, "parallel.schedule=gpipe")),
            case("pp2-1f1b-z3", 3, sets=PP2),
            case("pp2-uniform-z1", 1, sets=(*PP2, "parallel.partition=uniform")),
            case("pp2-ckpt1-z0", 0, sets=(*PP2, f"{CKPT}=1")),
            case("pp2-ckpt1-z3", 3, sets=(*PP2, f"{CKPT}=1")),
            # sharing these ranks (a second world costs seconds): pp=1 x dp=2, chunks of two layers
            case("pp1-dp2-ckpt2-z3", 3, sets=(f"{CKPT}=2",)),
        ],
    )
    for name, rows in got.items():
        assert_same(rows, single["ref-llama"], name)


@pytest.mark.dist
def test_gpt2_embedding_and_head_tied_across_stages(single, tmp_path):
    """The embedding (stage 0) and the head (last stage) share one weight: the owner sends it,
    the head's gradient comes back, norm and clipping count it once (pipeline/tied.py)."""
    got = run_cases(
        tmp_path,
        2,
        [case(f"gpt2-pp2-z{stage}", stage, "gpt2-tiny", sets=PP2) for stage in (0, 2, 3)],
    )
    for name, rows in got.items():
        assert_same(rows, single["ref-gpt2"], name)


@pytest.mark.dist
def test_bf16_pipeline_trains_close_to_fp32(single, tmp_path):
    """bf16 through DeepSpeed (ZeRO-0's BF16_Optimizer, ZeRO 1-3's fp32 master weights) on two
    stages: not bit-parity, but within 1% of the fp32 reference over five steps."""
    bf16 = (*PP2, "ds.bf16.enabled=true")
    got = run_cases(
        tmp_path,
        2,
        [
            *(case(f"bf16-pp2-z{s}", s, sets=bf16) for s in (0, 3)),
            # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, which cannot coalesce
            case("bf16-pp2-z1-fp32acc", 1, sets=(*bf16, "ds.data_types.grad_accum_dtype=fp32")),
        ],
    )
    for name, rows in got.items():
        for row, ref in zip(rows, single["ref-llama"], strict=True):
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-2), (name, row["step"])


@pytest.mark.dist
def test_two_stages_two_replicas_zero_0_to_3_and_four_stages(
    single, chat_sets, blend_sets, tmp_path
):
    got = run_cases(
        tmp_path,
        4,
        [
            *(case(f"pp2-dp2-z{stage}", stage, sets=PP2) for stage in range(4)),
            case("pp4-z0", 0, sets=("parallel.pp=4",)),
            case("pp4-gpipe-z1", 1, sets=("parallel.pp=4", "parallel.schedule=gpipe")),
            case("gpt2-pp2-dp2-z1", 1, "gpt2-tiny", sets=PP2),
            # ZeRO-3 keeping each stage's parameters gathered through the step (one gather a step)
            case("pp2-dp2-z3-keep", 3, sets=(*PP2, "parallel.reshard_after_forward=false")),
            # chat data: assistant-only loss (the mean over the global batch's counted labels) and
            # documents packed apart, which both stages read from the sampler; recomputation in
            # backward sees its own micro-batch's documents
            case("chat-pp2-dp2-z1", 1, sets=(*PP2, *chat_sets, f"{CKPT}=1")),
            # the same under tensor and sequence parallelism: the vocabulary-parallel loss weighed
            case(
                "chat-tp2-sp-dp2-z0",
                0,
                sets=(*chat_sets, "parallel.tp=2", "parallel.sequence_parallel=true"),
            ),
            # two token files blended 3:1, packed by document: both stages read the blend's samples
            case("blend-pp2-dp2-z1", 1, sets=(*PP2, *blend_sets)),
        ],
    )
    for name, rows in got.items():
        ref = {"chat": "ref-chat", "blen": "ref-blend"}.get(name[:4], "ref-llama")
        assert_same(rows, single["ref-gpt2" if name.startswith("gpt2") else ref], name)
