"""The run's plan, resolved before any rank starts (dsnd.plan.plan): stages, chunks, ties,
programs, and the refusals of layouts that cannot run."""

from __future__ import annotations

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError
from dsnd.plan.plan import plan_json
from dsnd.plan.schedule import simulate


def resolved(world: int, *sets: str):
    return resolve(load(None, list(sets)), world)


def test_stages_with_different_parameter_groups_are_refused_under_zero():
    # uniform at pp=4 leaves the head alone on the last stage: one group (decayed) against two
    sets = ("parallel.pp=4", "parallel.partition=uniform")
    assert resolved(4, *sets).plan.parts == (0, 2, 4, 6, 7)  # ZeRO-0: dsnd measures the norm
    with pytest.raises(UserError, match=r"\[2, 2, 2, 1\] per stage.*ZeRO-1.*would hang"):
        resolved(4, *sets, "deepspeed=ds_configs/zero1.json")


@pytest.mark.parametrize(
    "sets",
    [
        ("parallel.pp=4", "deepspeed=ds_configs/zero3.json"),  # parameters: [0, 2, 3, 4, 7]
        ("parallel.pp=2", "model.preset=gpt2-tiny", "deepspeed=ds_configs/zero3.json"),
    ],
)
def test_runnable_layouts_pass(sets):
    pp = int(sets[0].split("=")[1])
    plan = resolved(pp, *sets).plan
    assert len(plan.programs) == pp


def test_an_empty_stage_is_refused_before_start():
    with pytest.raises(UserError, match="parallel.partition"):
        resolved(2, "parallel.pp=2", "parallel.partition=[0, 7, 7]")


def test_interleaved_plan_holds_two_chunks_per_stage_and_ties_across_the_ring():
    res = resolved(
        2,
        "parallel.pp=2",
        "parallel.schedule=interleaved-1f1b",
        "parallel.virtual_stages=2",
        "model.preset=gpt2-tiny",
        "model.num_layers=4",
        "ds.gradient_accumulation_steps=4",
        "ds.train_batch_size=null",
    )
    plan = res.plan
    assert len(plan.parts) == 5  # 4 virtual stages
    for stage in range(2):
        layers = plan.stage_layers(stage)
        assert layers == plan.chunk_layers(stage, 0) + plan.chunk_layers(stage, 1)
    assert sorted(plan.stage_layers(0) + plan.stage_layers(1)) == list(range(plan.parts[-1]))
    (tie,) = plan.ties
    assert (tie.owner, tie.borrower) == (0, 1)
    assert [plan.role(s).tie for s in range(2)] == ["owner", "borrower"]
    simulate([list(p) for p in plan.programs], [plan.role(s) for s in range(2)])
    as_json = plan_json(plan)
    assert as_json["virtual_stages"] == 2 and as_json["bubble_unit_costs"] == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "sets, message",
    [
        (("parallel.schedule=interleaved-1f1b",), "needs parallel.pp >= 2"),
        (("parallel.pp=2", "parallel.schedule=interleaved-1f1b"), "virtual_stages >= 2"),
        (("parallel.pp=2", "parallel.virtual_stages=2"), "needs parallel.schedule=interleaved"),
        (
            (
                "parallel.pp=2",
                "parallel.schedule=interleaved-1f1b",
                "parallel.virtual_stages=2",
                "ds.gradient_accumulation_steps=3",
                "ds.train_batch_size=null",
            ),
            "gradient_accumulation_steps=3.*multiple of parallel.pp=2",
        ),
        (
            ("parallel.pp=2", "parallel.schedule=zb-h1", "deepspeed=ds_configs/zero3.json"),
            "zb-h1 runs with ZeRO stages 0, 1, 2, not zero_optimization.stage=3",
        ),
        (("parallel.pp=2", "parallel.virtual_stages=0"), "virtual_stages=0 must be >= 1"),
        (
            (
                "parallel.pp=2",
                "deepspeed=ds_configs/zero3.json",
                "ds.zero_optimization.sub_group_size=0",
            ),
            "sub_group_size=0 splits a pipeline stage's .* parameters into ZeRO-3 sub-groups",
        ),
        # the chunk count is named by the keys the user set, not as a parallel.pp they did not
        (
            (
                "parallel.pp=2",
                "parallel.schedule=interleaved-1f1b",
                "parallel.virtual_stages=8",
                "ds.gradient_accumulation_steps=8",
                "ds.train_batch_size=null",
            ),
            r"^parallel.pp=2 x parallel.virtual_stages=8 = 16 model chunks is more than the "
            r"model's \d+ pipeline layers",
        ),
    ],
)
def test_schedules_refuse_what_they_cannot_run(sets, message):
    world = 2 if "parallel.pp=2" in sets else 1
    with pytest.raises(UserError, match=message):
        resolved(world, *sets)


def test_describe_prints_stages_ties_and_a_timeline_row_per_stage():
    plan = resolved(2, "parallel.pp=2", "model.preset=gpt2-tiny", "parallel.schedule=zb-h1").plan
    lines = plan.describe(width=60)
    assert lines[0].startswith("plan: pp=2 dp=1 tp=1, ZeRO-0, schedule zb-h1")
    assert any("tied 'embed': stage 0 owns it, stage 1 borrows it" in line for line in lines)
    rows = [
        line
        for line in lines
        if line.strip().startswith("stage ") and ":" in line and "layers" not in line
    ]
    assert len(rows) == 2 and all(set(r.split(": ")[1]) <= set("FIW.") for r in rows)
