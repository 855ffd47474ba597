"""Checkpoints on real ranks: exact resume on the same layout, and reshaping on load.

Same layout: 10 steps straight equal 5 steps, a save, a new `train` that resumes (auto) and 5
more — float equality of every loss, gradient norm and learning rate, pp=2 x dp=2 at ZeRO-1
and ZeRO-3, and at ZeRO-3 with checkpoint.async (against the synchronous straight run).
Reshape: a checkpoint saved at pp=2 x dp=2 ZeRO-3 step 5 resumed at pp=1 x dp=4
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
    straight = case(
        f"straight-{tag}", zero, sets=(*sets, "train.steps=10", "checkpoint.resume=never")
    )
    first = case(f"halves-{tag}", zero, sets=(*sets, "train.steps=5"))
    rest = case(f"halves-{tag}", zero, sets=(*sets, "train.steps=10"))
    rest["name"] = f"halves-{tag}-rest"
    return [straight, first, rest]


def _assert_exact(got: dict, tag: str, straight: str | None = None) -> None:
    """The halves of `tag` equal the straight run of `straight` (default: `tag`'s own)."""
    full = got[f"straight-{straight or tag}"]
    assert [r["step"] for r in full] == list(range(1, 11)), tag
    first, second = got[f"halves-{tag}"], got[f"halves-{tag}-rest"]
    assert [r["step"] for r in second] == list(range(6, 11)), tag
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in first + second] == [r[key] for r in full], (tag, key)


BETAS = "ds.optimizer.params.betas=[0.5, 0.6]"  # the packaged JSON's: [0.9, 0.95]


def _assert_new_betas_apply(got: dict) -> None:
    """Betas changed on resume are the resumed run's (the checkpoint gives the optimizer's state,
    not its hyper-parameters): steps 6-10 are the single-process reference's whose optimizer
    takes them at step 6, not the unchanged run's."""
    from dsnd.config.load import load
    from dsnd.config.resolve import resolve
    from tests.reference import reference_rows

    res = resolve(load(None, ["train.steps=10", "deepspeed=ds_configs/zero1.json", *PP2]), 4)
    want = reference_rows(res, (5, {"betas": (0.5, 0.6)}))[5:]
    rows = got["betas-z1"]
    assert [r["step"] for r in rows] == list(range(6, 11))
    for row, ref in zip(rows, want, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert row[key] == pytest.approx(ref[key], rel=RTOL), ("betas", row["step"], key)
    assert rows[-1]["loss"] != pytest.approx(got["straight-z1"][-1]["loss"], rel=RTOL)


@pytest.mark.dist
def test_resume_is_exact_and_reshapes(tmp_path):
    saved = os.path.join(tmp_path, "halves-z3", "checkpoints", "step_00000005")
    reshaped = [
        case("to-pp1-dp4-z1", 1, sets=("train.steps=10", f"checkpoint.resume={saved}")),
        case(
            "to-pp4-z0", 0, sets=("parallel.pp=4", "train.steps=10", f"checkpoint.resume={saved}")
        ),
        case(
            "to-tp2-pp2-z3",
            3,
            sets=(*PP2, "parallel.tp=2", "train.steps=10", f"checkpoint.resume={saved}"),
        ),
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
    got = run_cases(
        tmp_path,
        4,
        [
            *_exact_cases("z1", 1, *PP2),
            case(
                "betas-z1",
                1,
                sets=(
                    *PP2,
                    BETAS,
                    "train.steps=10",
                    "checkpoint.resume="
                    + os.path.join(tmp_path, "halves-z1", "checkpoints", "step_00000005"),
                ),
            ),
            *_exact_cases("z3", 3, *PP2),
            # the same halves with checkpoint.async (its collectives under the NCCL replay)
            *_exact_cases("z3-async", 3, *PP2, "checkpoint.async=true")[1:],
            *reshaped,
            # bf16: the fp32 masters are saved, the bf16 weights restored from them
            *_exact_cases("bf16-z0", 0, *bf16),  # FP16_UnfusedOptimizer (fp16/fp32 group lists)
            *_exact_cases("bf16-z2", 2, *bf16),
        ],
    )
    for tag in ("z1", "z3", "bf16-z0", "bf16-z2"):
        _assert_exact(got, tag)
    _assert_exact(got, "z3-async", straight="z3")  # asynchronous saves resume bit for bit
    _assert_new_betas_apply(got)
    want = got["straight-z3"][5:]
    for c in reshaped:
        rows = got[c["name"]]
        assert [r["step"] for r in rows] == list(range(6, 11)), c["name"]
        for row, ref in zip(rows, want, strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert row[key] == pytest.approx(ref[key], rel=RTOL), (c["name"], row["step"], key)
    _assert_marked(got)


def _assert_marked(got: dict) -> None:
    """Each run's first row says where it started and on which layout (`dsnd plot` and
    TensorBoard mark resumes and layout changes from it); a default run evaluates at its end."""
    pp2 = {"pp": 2, "dp": 2, "tp": 1, "cp": 1, "ep": 1, "world": 4}
    assert got["halves-z3"][0]["run_start"] == {
        "step": 0,
        "layout": pp2,
        "resumed_from": None,
        "saved_layout": None,
    }
    again = got["halves-z3-rest"][0]["run_start"]
    assert (again["step"], again["layout"], again["saved_layout"]) == (5, pp2, pp2)
    assert again["resumed_from"].endswith("step_00000005")
    moved = got["to-pp1-dp4-z1"][0]["run_start"]
    assert (moved["layout"], moved["saved_layout"]) == ({**pp2, "pp": 1, "dp": 4}, pp2)
    for rows in (got["halves-z3"], got["halves-z3-rest"]):
        assert ["run_start" in r for r in rows] == [True] + [False] * 4
        assert ["eval_loss" in r for r in rows] == [False] * 4 + [True]
