"""Pipeline stages (1F1B / GPipe) x ZeRO 0-3 equal a plain single-process PyTorch run.

Real gloo ranks, one DeepSpeed engine per stage sharded over the stage's data-parallel group, same
global batch (16) for every layout; losses, global gradient norms (over all stages) and learning
rates within 1e-4 relative.
"""

from __future__ import annotations

import pytest

from tests.dist.parity import assert_same, case, run_cases

PP2 = ("parallel.pp=2",)


@pytest.mark.dist
def test_two_stages_one_replica_1f1b_and_gpipe(single, tmp_path):
    got = run_cases(tmp_path, 2, [
        case("pp2-1f1b-z0", 0, sets=PP2),
        case("pp2-gpipe-z0", 0, sets=(*PP2, "parallel.schedule=gpipe")),
        case("pp2-1f1b-z3", 3, sets=PP2),
        case("pp2-uniform-z1", 1, sets=(*PP2, "parallel.partition=uniform")),
    ])  # fmt: skip
    for name, rows in got.items():
        assert_same(rows, single["ref-llama"], name)


@pytest.mark.dist
def test_gpt2_embedding_and_head_tied_across_stages(single, tmp_path):
    """The embedding (stage 0) and the head (last stage) share one weight: the owner sends it,
    the head's gradient comes back, norm and clipping count it once (pipeline/tied.py)."""
    got = run_cases(tmp_path, 2, [
        case(f"gpt2-pp2-z{stage}", stage, "gpt2-tiny", sets=PP2) for stage in (0, 2, 3)
    ])  # fmt: skip
    for name, rows in got.items():
        assert_same(rows, single["ref-gpt2"], name)


@pytest.mark.dist
def test_two_stages_two_replicas_zero_0_to_3_and_four_stages(single, tmp_path):
    got = run_cases(tmp_path, 4, [
        *(case(f"pp2-dp2-z{stage}", stage, sets=PP2) for stage in range(4)),
        case("pp4-z0", 0, sets=("parallel.pp=4",)),
        case("gpt2-pp2-dp2-z1", 1, "gpt2-tiny", sets=PP2),
    ])  # fmt: skip
    for name, rows in got.items():
        assert_same(rows, single["ref-gpt2" if name.startswith("gpt2") else "ref-llama"], name)
