"""Checkpoints on real ranks: exact resume on the same layout, and reshaping on load.

Same layout: 10 steps straight equal 5 steps, a save, a new `train` that resumes (auto) and 5
more — float equality of every loss, gradient norm and learning rate, pp=2 x dp=2 at ZeRO-1
and ZeRO-3. Reshape: a checkpoint saved at pp=2 x dp=2 ZeRO-3 step 5 resumed at pp=1 x dp=4
(ZeRO-1), pp=4 x dp=1 (ZeRO-0) and tp=2 x pp=2 (ZeRO-3) continues the uninterrupted run within
1e-4 (the optimizer state moves too: without it the losses would differ from step 6 on).
"""

from __future__ import annotations

import os

import pytest

from tests.dist.parity import RTOL, case, run_cases

PP2 = ("parallel.pp=2",)


@pytest.mark.dist
def test_resume_is_exact_and_reshapes(tmp_path):
    straight = {z: case(f"straight-z{z}", z, sets=(*PP2, "train.steps=10",
                                                   "checkpoint.resume=never"))
                for z in (1, 3)}  # fmt: skip
    # the first half saves at step 5 and stops; the second half (same log.dir) resumes from it
    half = {z: case(f"halves-z{z}", z, sets=(*PP2, "train.steps=5")) for z in (1, 3)}
    rest = {z: case(f"halves-z{z}", z, sets=(*PP2, "train.steps=10")) for z in (1, 3)}
    for z in (1, 3):
        rest[z]["name"] = f"halves-z{z}-rest"
    saved = os.path.join(tmp_path, "halves-z3", "checkpoints", "step_00000005")
    reshaped = [
        case("to-pp1-dp4-z1", 1, sets=("train.steps=10", f"checkpoint.resume={saved}")),
        case("to-pp4-z0", 0, sets=("parallel.pp=4", "train.steps=10",
                                   f"checkpoint.resume={saved}")),  # fmt: skip
        case("to-tp2-pp2-z3", 3, sets=(*PP2, "parallel.tp=2", "train.steps=10",
                                       f"checkpoint.resume={saved}")),  # fmt: skip
    ]
    got = run_cases(tmp_path, 4, [*straight.values(), half[1], rest[1], half[3], rest[3],
                                  *reshaped])  # fmt: skip
    for z in (1, 3):
        full = got[f"straight-z{z}"]
        assert [r["step"] for r in full] == list(range(1, 11))
        first, second = got[f"halves-z{z}"], got[f"halves-z{z}-rest"]
        assert [r["step"] for r in second] == list(range(6, 11))
        for key in ("loss", "grad_norm", "lr"):
            assert [r[key] for r in first + second] == [r[key] for r in full], (z, key)
    want = got["straight-z3"][5:]
    for c in reshaped:
        rows = got[c["name"]]
        assert [r["step"] for r in rows] == list(range(6, 11)), c["name"]
        for row, ref in zip(rows, want, strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert row[key] == pytest.approx(ref[key], rel=RTOL), (c["name"], row["step"], key)
