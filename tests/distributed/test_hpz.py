"""ZeRO++ hpZ (`zero_hpz_partition_size`) inside pipeline stages, in one 4-rank job:

- pp=2 x dp=2, hpZ 2 (each stage's secondary partition is its data-parallel pair): its first
  5 steps equal the single-process reference within 1e-4; 5 steps + save + resume 5 equal 10
  straight, bit for bit.
- pp=1 x dp=4, hpZ 2 (the secondary partition over half of the data-parallel group), and
  tp=2 x dp=2, hpZ 2: the reference within 1e-4.

Each rank logs its hpZ group: consecutive ranks of its stage's data-parallel group. With tp=2
that is ranks 0 and 2 (DeepSpeed cuts its groups from the whole world: 0 and 1, a
tensor-parallel pair; it also fails on dsnd's second zero.Init of a stage, measured: "ZeRO
parameter intra parallel group is already initialized").
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import STEPS, assert_same, case, run_cases
from tests.distributed.test_checkpoint_resume import _assert_exact, _exact_cases
from tests.procs import last_log_text

HPZ = "ds.zero_optimization.zero_hpz_partition_size=2"


def _hpz_ranks(tmp_path, name: str, rank: int) -> str:
    return last_log_text(tmp_path / name, rank, "ZeRO++ hpZ: ").rsplit("over ranks ", 1)[1]


@pytest.mark.dist
def test_hpz_parity_and_exact_resume(single, tmp_path):
    got = run_cases(
        tmp_path,
        4,
        [
            *_exact_cases("z3-hpz", 3, "parallel.pp=2", HPZ),
            case("hpz-pp1-dp4", 3, sets=(HPZ,)),
            case("hpz-tp2", 3, sets=("parallel.tp=2", HPZ)),
        ],
    )
    ref = single["ref-llama"]
    assert_same(got["straight-z3-hpz"][:STEPS], ref, "straight-z3-hpz")
    _assert_exact(got, "z3-hpz")
    assert_same(got["hpz-pp1-dp4"], ref, "hpz-pp1-dp4")
    assert_same(got["hpz-tp2"], ref, "hpz-tp2")
    want = {
        "straight-z3-hpz": ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"],
        "hpz-pp1-dp4": ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"],
        "hpz-tp2": ["[0, 2]", "[1, 3]", "[0, 2]", "[1, 3]"],
    }
    for name, ranks in want.items():
        assert [_hpz_ranks(tmp_path, name, r) for r in range(4)] == ranks, name
