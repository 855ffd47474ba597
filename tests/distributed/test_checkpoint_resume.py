"""Checkpoints on real ranks: exact resume on the same layout, and reshaping on load.

Same layout: 10 steps straight equal 5 steps, a save, a new `train` that resumes (auto) and 5
more — float equality of every loss, gradient norm and learning rate, pp=2 x dp=2 at ZeRO-1
and ZeRO-3. Reshape: a checkpoint saved at pp=2 x dp=2 ZeRO-3 step 5 resumed at pp=1 x dp=4
(ZeRO-1), pp=4 x dp=1 (ZeRO-0), tp=2 x pp=2 (ZeRO-3), interleaved 1F1B (two chunks per
stage, ZeRO-1) and ZB-H1 (ZeRO-2) continues the uninterrupted run within
1e-4 (the optimizer state moves too: without it the losses would differ from step 6 on).
bf16 (ZeRO-0 and ZeRO-2) resumes exactly too.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.parity import RTOL, case, run_cases

PP2 = ("parallel.pp=2",)


def _exact_cases(tag: str, zero: int, *sets: str) -> list[dict]:
    """Straight 10 steps; and 5 steps, then (same log.dir, so checkpoint.resume=auto finds the
    step-5 checkpoint) up to 10."""
    straight = case(f"straight-{tag}", zero, sets=(*sets, "train.steps=10",
                                                    "checkpoint.resume=never"))  # fmt: skip
    first = case(f"halves-{tag}", zero, sets=(*sets, "train.steps=5"))
    rest = case(f"halves-{tag}", zero, sets=(*sets, "train.steps=10"))
    rest["name"] = f"halves-{tag}-rest"
    return [straight, first, rest]


def _assert_exact(got: dict, tag: str) -> None:
    full = got[f"straight-{tag}"]
    assert [r["step"] for r in full] == list(range(1, 11)), tag
    first, second = got[f"halves-{tag}"], got[f"halves-{tag}-rest"]
    assert [r["step"] for r in second] == list(range(6, 11)), tag
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in first + second] == [r[key] for r in full], (tag, key)


@pytest.mark.dist
def test_resume_is_exact_and_reshapes(tmp_path):
    saved = os.path.join(tmp_path, "halves-z3", "checkpoints", "step_00000005")
    reshaped = [
        case("to-pp1-dp4-z1", 1, sets=("train.steps=10", f"checkpoint.resume={saved}")),
        case(
            "to-pp4-z0", 0, sets=("parallel.pp=4", "train.steps=10", f"checkpoint.resume={saved}")
        ),  # fmt: skip
        case(
            "to-tp2-pp2-z3",
            3,
            sets=(*PP2, "parallel.tp=2", "train.steps=10", f"checkpoint.resume={saved}"),
        ),  # fmt: skip
        # onto the other schedules: two chunks per stage (layers regrouped), a split backward
        case(
            "to-interleaved-z1",
            1,
            sets=(
                *PP2,
                "parallel.schedule=interleaved-1f1b",
                "parallel.virtual_stages=2",
                "train.steps=10",
                f"checkpoint.resume={saved}",
            ),
        ),
        case(
            "to-zb-h1-z2",
            2,
            sets=(*PP2, "parallel.schedule=zb-h1", "train.steps=10", f"checkpoint.resume={saved}"),
        ),
    ]
    bf16 = (*PP2, "ds.bf16.enabled=true")
    got = run_cases(tmp_path, 4, [
        *_exact_cases("z1", 1, *PP2),
        *_exact_cases("z3", 3, *PP2),
        *reshaped,
        # bf16: the fp32 masters are saved, the bf16 weights restored from them
        *_exact_cases("bf16-z0", 0, *bf16),  # FP16_UnfusedOptimizer (fp16/fp32 group lists)
        *_exact_cases("bf16-z2", 2, *bf16),
    ])  # fmt: skip
    for tag in ("z1", "z3", "bf16-z0", "bf16-z2"):
        _assert_exact(got, tag)
    want = got["straight-z3"][5:]
    for c in reshaped:
        rows = got[c["name"]]
        assert [r["step"] for r in rows] == list(range(6, 11)), c["name"]
        for row, ref in zip(rows, want, strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert row[key] == pytest.approx(ref[key], rel=RTOL), (c["name"], row["step"], key)
