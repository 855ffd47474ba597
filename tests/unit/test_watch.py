"""What rank 0's Reporter marks for whoever watches a run: a resume and a layout change (text
and `events/` scalars in TensorBoard), a router collapsing (a warning, a metrics field, a
TensorBoard scalar), and a closing line naming every output."""

from __future__ import annotations

import json
import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.report.reporter import Reporter, start_mark

DP2 = {"pp": 1, "dp": 2, "tp": 1, "cp": 1, "ep": 1, "world": 2}
PP2 = {**DP2, "pp": 2, "dp": 1}


def _row(step: int) -> dict:
    return {
        "step": step,
        "loss": 5.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 100.0,
        "step_time_s": 1.0,
    }


def _load(worst: float) -> dict:
    """Expert-load tags of a step: MoE block 1's busiest expert at `worst` x the mean."""
    return {"moe/layer1_load_max_over_mean": worst, "moe/layer3_load_max_over_mean": 1.2}


def _reporter(tmp_path, *sets: str) -> Reporter:
    return Reporter(
        resolve(load(None, [f"log.dir={tmp_path / 'run'}", "train.steps=20", *sets]), 1)
    )


def test_a_resume_on_another_layout_is_marked_in_tensorboard(tmp_path):
    reporter = _reporter(tmp_path)
    reporter.write({**_row(1), "run_start": start_mark(0, DP2)}, {})
    reporter.write(_row(2), {})
    why = "restart 1 of 1 after: the agent on host h3 ended without a report"  # dsnd launch's
    reporter.write({**_row(6), "run_start": start_mark(5, PP2, "ck/step_00000005", DP2, why)}, {})
    reporter.close()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    for tag in ("events/resume", "events/layout_change"):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(5, 1.0)], tag
    texts = [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in events.Tensors("events/text_summary")
    ]
    assert texts == [
        (0, "started at step 0 on pp=1 dp=2 tp=1 cp=1 ep=1 (world 2)"),
        (
            5,
            "resumed, layout pp 1->2 dp 2->1: at step 5 from ck/step_00000005 on pp=2 dp=1 tp=1 "
            f"cp=1 ep=1 (world 2), saved on pp=1 dp=2 tp=1 cp=1 ep=1 ({why})",
        ),
    ]


def test_a_busiest_expert_over_the_threshold_for_5_steps_is_warned_once(tmp_path, caplog):
    """2.5x the mean for steps 3-9 (after a dip at step 2): one warning, at step 7 (the 5th
    step over), in metrics.jsonl and TensorBoard; 2.0 (not over) and a lone spike are quiet."""
    reporter = _reporter(tmp_path)
    worst = {1: 2.5, 2: 2.0, **{s: 2.5 for s in range(3, 10)}, 10: 1.1, 11: 9.0}
    with caplog.at_level(logging.WARNING, logger="dsnd.report"):
        for step, load_ in worst.items():
            reporter.write(_row(step), _load(load_))
    reporter.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        "expert load: MoE layer 1's busiest expert got 2.50x the mean "
        "tokens, over log.expert_load_warn 2.0, for 5 steps in a row: "
        "the router is collapsing onto few experts"
    )
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        alerts = {r["step"]: r.get("moe_load_alert") for r in map(json.loads, f)}
    assert {s: a for s, a in alerts.items() if a} == {
        7: {"layer": 1, "max_over_mean": 2.5, "steps": 5}
    }
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("events/expert_load")] == [(7, 2.5)]


def test_a_model_whose_experts_cannot_reach_the_threshold_is_watched_below_its_ceiling(
    tmp_path, caplog
):
    """mixtral-tiny: 4 experts, top-2, so at most 2.0x the mean (every token picks the expert):
    over 90% of that (1.8x) for 5 steps is a collapse although 2.0 is never passed."""
    reporter = _reporter(tmp_path, "model.preset=mixtral-tiny", "log.tensorboard=false")
    with caplog.at_level(logging.WARNING, logger="dsnd.report"):
        for step, worst in enumerate([1.55, 1.81, 1.97, 1.99, 1.99, 2.0], start=1):
            reporter.write(_row(step), _load(worst))
    reporter.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert (
        "got 2.00x the mean tokens, over log.expert_load_warn 2.0, capped at 1.80x: 90% of "
        "the most an expert can get here, for 5 steps in a row"
    ) in warning


def test_expert_load_warn_0_never_warns(tmp_path, caplog):
    reporter = _reporter(tmp_path, "log.expert_load_warn=0", "log.tensorboard=false")
    with caplog.at_level(logging.WARNING, logger="dsnd.report"):
        for step in range(1, 10):
            reporter.write(_row(step), _load(8.0))
    reporter.close()
    assert caplog.records == []


@pytest.mark.parametrize(
    "saved, export, names",
    [
        ("out/checkpoints/step_00000020", None, "checkpoint out/checkpoints/step_00000020"),
        (None, "hf", "checkpoints out/checkpoints (none saved)"),
    ],
)
def test_the_closing_line_names_every_output(tmp_path, monkeypatch, saved, export, names):
    monkeypatch.chdir(tmp_path)
    reporter = Reporter(resolve(load(None, ["log.dir=out"]), 1))
    line = reporter.closing_line(saved, "out/checkpoints", export)
    reporter.close()
    tail = ", export hf" if export else ""
    assert line == (
        f"outputs: metrics out/metrics.jsonl, {names}, TensorBoard out, logs out/logs{tail}"
    )
