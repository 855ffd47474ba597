"""Held-out evaluation (eval.every): forward-only passes through the pipeline give the same
eval loss on every layout, at the steps asked for, next to the training loss."""

from __future__ import annotations

import math

import pytest

from tests.distributed.parity import RTOL, case, run_cases

EVAL = ("eval.every=2", "eval.batches=2", "train.steps=4")


@pytest.mark.dist
def test_eval_loss_every_n_steps_is_layout_independent(tmp_path):
    got = run_cases(
        tmp_path,
        2,
        [
            case("llama-pp2-z1", 1, sets=(*EVAL, "parallel.pp=2")),
            case("llama-dp2-z3", 3, sets=EVAL),
            case(
                "gpt2-pp2-z0", 0, "gpt2-tiny", sets=(*EVAL, "parallel.pp=2")
            ),  # tied across stages
            case("gpt2-tp2-z2", 2, "gpt2-tiny", sets=(*EVAL, "parallel.tp=2")),
        ],
    )
    for family in ("llama", "gpt2"):
        a, b = (rows for name, rows in got.items() if name.startswith(family))
        for x, y in zip(a, b, strict=True):
            assert ("eval_loss" in x) == (x["step"] % 2 == 0) == ("eval_loss" in y)
            assert x["loss"] == pytest.approx(y["loss"], rel=RTOL)
            if "eval_loss" in x:
                assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=RTOL)
                assert x["eval_perplexity"] == pytest.approx(math.exp(x["eval_loss"]))
                assert abs(x["eval_loss"] - x["loss"]) < 0.2 * x["loss"]  # same kind of text
        assert a[3]["eval_loss"] < a[1]["eval_loss"]  # the model learns what it is not shown
