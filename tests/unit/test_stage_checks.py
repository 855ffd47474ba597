"""Stage checks that run before any rank starts (dsnd.pipeline.stage.check_stages)."""

from __future__ import annotations

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError
from dsnd.pipeline.stage import check_stages, stage_parts


def resolved(world: int, *sets: str):
    return resolve(load(None, list(sets)), world)


def test_stages_with_different_parameter_groups_are_refused_under_zero():
    # uniform at pp=4 leaves the head alone on the last stage: one group (decayed) against two
    res = resolved(
        4, "parallel.pp=4", "parallel.partition=uniform", "deepspeed=ds_configs/zero1.json"
    )
    assert stage_parts(res) == [0, 2, 4, 6, 7]
    with pytest.raises(UserError, match=r"\[2, 2, 2, 1\] per stage.*ZeRO-1.*would hang"):
        check_stages(res)


@pytest.mark.parametrize(
    "sets",
    [
        ("parallel.pp=4", "parallel.partition=uniform"),  # ZeRO-0: dsnd measures the norm itself
        ("parallel.pp=4", "deepspeed=ds_configs/zero3.json"),  # parameters: [0, 2, 3, 4, 7]
        ("parallel.pp=2", "model.preset=gpt2-tiny", "deepspeed=ds_configs/zero3.json"),
    ],
)
def test_runnable_layouts_pass(sets):
    pp = int(sets[0].split("=")[1])
    check_stages(resolved(pp, *sets))


def test_an_empty_stage_is_refused_before_start():
    with pytest.raises(UserError, match="parallel.partition"):
        check_stages(resolved(2, "parallel.pp=2", "parallel.partition=[0, 7, 7]"))
