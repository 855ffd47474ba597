"""The pure halves of `dsnd bench zero-memory` and `dsnd bench activation-checkpointing`: the
formulas they compare with and their rows, from raw JSON built by hand (no processes)."""

from __future__ import annotations

import pytest

from dsnd import cli
from dsnd.bench import memory_results as mr
from dsnd.bench.rows import format_table
from dsnd.commands.bench import BENCHES, DEFAULT_REPS
from dsnd.plan.memory import model_state_bytes

LAYOUT = {"pp": 2, "dp": 2, "bf16": False, "optimizer": "AdamW", "state_bytes": 8}


def test_formula_is_the_plans_model_state_bytes_with_the_gradients_held_whole():
    # the ZeRO formula: 16, 14, 12, 10 Psi at Nd=2; dsnd's step holds whole gradients until its
    # one reduction: + 2 Psi at ZeRO-2 (whole 4 Psi, formula 2 Psi), + 4 Psi at ZeRO-3 (whole
    # gradients besides the partition buffer)
    for stage, total, held in zip(
        (0, 1, 2, 3), (16000, 14000, 14000, 14000), (0, 0, 2000, 4000), strict=True
    ):
        want = model_state_bytes(stage, 1000, 2, bf16=False)["device"]
        got = mr.formula_bytes(stage, 1000, 2, LAYOUT)
        assert got == {**want, "grads": want["grads"] + held} and sum(got.values()) == total
    # bf16: 2-byte parameters and gradients, fp32 master and Adam: (2 + 2 + 4 + 8) * psi / 2,
    # plus the whole 2-byte gradients
    assert sum(mr.formula_bytes(3, 1000, 2, {**LAYOUT, "bf16": True}).values()) == 10000


def _parts(params: int, grads: int, master: int, optimizer: int) -> dict:
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer}


def _record(stage: int, psi: int, backward: dict, reduced: dict, after: dict) -> dict:
    points = [
        ["backward_loss", backward],
        ["backward_loss", backward],
        ["reduce", reduced],
        ["step", after],
    ]
    return {"stage": stage, "psi": psi, "nd": 2, "points": points}


RANKS = ((0, 1000), (1, 1100), (0, 1000), (1, 1100))  # (pipeline stage, psi) of ranks 0-3


def _zero_raw() -> dict:
    """psi 1000 on pipeline stage 0, 1100 on stage 1; ZeRO-1 as the formula, ZeRO-3 with whole
    gradients (and its partition buffer) while accumulating."""
    z1 = [
        _record(
            s,
            psi,
            _parts(4 * psi, 4 * psi, 2 * psi, 4 * psi),
            _parts(4 * psi, 0, 2 * psi, 4 * psi),
            _parts(4 * psi, 0, 2 * psi, 4 * psi),
        )
        for s, psi in RANKS
    ]
    z3 = [
        _record(
            s,
            psi,
            _parts(2 * psi, 6 * psi, 2 * psi, 4 * psi),
            _parts(2 * psi, 2 * psi, 2 * psi, 4 * psi),
            _parts(2 * psi, 2 * psi, 2 * psi, 4 * psi),
        )
        for s, psi in RANKS
    ]
    z3[3]["points"][0][1] = _parts(2200, 6600, 2200, 4600)  # rank 3 a little further from 1
    return {"layout": LAYOUT, "warmup": 1, "steps": 1, "stages": {"1": z1, "3": z3}}


def test_zero_memory_rows_compare_each_ranks_peak_with_its_stages_formula():
    rows = mr.zero_memory_rows(_zero_raw())
    by = {row.metric: row for row in rows}
    assert list(by) == [
        "zero1_state_bytes_vs_formula",
        "zero1_state_bytes_at_reduction_vs_formula",
        "zero3_state_bytes_vs_formula",
        "zero3_state_bytes_at_reduction_vs_formula",
    ]
    assert all(row.bench == "zero-memory" for row in rows)
    z1 = by["zero1_state_bytes_vs_formula"]
    assert (z1.value, z1.met, z1.target.text) == (pytest.approx(1.0), True, "1 ±5%")
    assert "Gradients at the peak" not in z1.note
    reduced = by["zero1_state_bytes_at_reduction_vs_formula"]
    assert reduced.value == pytest.approx(10 / 14) and reduced.target is None
    assert "does not count" in reduced.note
    z3 = by["zero3_state_bytes_vs_formula"]
    # rank 3 (stage 1, psi 1100): 15600 / (28 * 1100 / 2) is the farthest from 1
    assert z3.value == pytest.approx(15600 / 15400) and z3.met is True
    assert "rank 3 (pipeline stage 1, Psi 1100, Nd 2)" in z3.note
    assert "every rank's ratio: 1.000, 1.000, 1.000, 1.013." in z3.note
    assert "measured params 2200 + grads 6600 + master 2200 + optimizer 4600 = 15600" in z3.note
    assert (
        "formula (model_state_bytes + held_gradient_bytes, AdamW 8 B/param) params 2200 + "
        "grads 6600"
    ) in z3.note
    assert "Gradients at the peak: 6600 bytes >= the stage's whole gradients (4400)" in z3.note
    assert by["zero3_state_bytes_at_reduction_vs_formula"].value == pytest.approx(10 / 14)
    assert "does not count" not in by["zero3_state_bytes_at_reduction_vs_formula"].note


def test_peak_and_reduction_points():
    points = [
        ("backward_output", _parts(1, 2, 0, 0)),
        ("reduce", _parts(1, 1, 0, 0)),
        ("step", _parts(3, 0, 0, 0)),
    ]
    assert mr.peak_point(points)[0] == "backward_output"  # the first of equal totals
    assert mr.reduction_point(points)[1] == _parts(1, 1, 0, 0)
    with pytest.raises(ValueError):
        mr.peak_point([])


@pytest.mark.parametrize(
    ("interval", "per_token"),
    [
        (1, 8 + 6 * 1024 + 1024 + 8),  # every layer a chunk: ids + 6 hidden inputs + the loss's
        (2, 8 + 3 * 1024 + 1024 + 8),  # chunks [0,2) [2,4) [4,6) [6,7)
        (0, 8 + 1024 + 8),
    ],  # off: one chunk (the count is then meaningless: nothing recomputes)
)
def test_checkpointed_bytes(interval, per_token):
    # llama at hidden 256, vocab 256: embedding, 4 blocks, norm, head = 7 pipeline layers
    got = mr.checkpointed_bytes(7, interval, micro=2, seq=512, hidden=256, vocab=256)
    assert got == 1024 * per_token


def _run(step_s: float, loss: float, peak: int) -> dict:
    return {
        "step_s": step_s,
        "loss": loss,
        "forward_s": step_s / 3,
        "backward_s": step_s / 2,
        "activation_peak_bytes": peak,
    }


def _checkpointing_raw(on_loss_shift: float = 0.0) -> dict:
    steps = [(9.0, 9.0), (1.0, 1.2), (1.0, 1.3), (2.0, 2.2)]  # (off, on) seconds; first warm-up
    reps = [
        {
            "rep": i,
            "timed": i > 0,
            "order": ["off", "on"],
            "runs": {
                "off": _run(off, 5.0 - i, 88_000_000),
                "on": _run(on, 5.0 - i + on_loss_shift, 7_356_420),
            },
        }
        for i, (off, on) in enumerate(steps)
    ]
    layout = {
        "model": "llama",
        "batch": "Batch(train=4, micro=2, gas=2)",
        "micro": 2,
        "seq_len": 512,
        "hidden": 256,
        "vocab": 256,
        "layers": 7,
        "interval": 1,
    }
    return {"layout": layout, "reps": reps}


def test_checkpointing_rows():
    rows = mr.checkpointing_rows(_checkpointing_raw())
    by = {row.metric: row for row in rows}
    assert list(by) == [
        "activation_peak_ratio",
        "checkpointed_bytes_vs_predicted",
        "step_time_ratio",
        "losses_max_rel_diff",
    ]
    assert all(row.bench == "activation-checkpointing" for row in rows)
    ratio = by["activation_peak_ratio"]
    assert (ratio.value, ratio.met) == (pytest.approx(7_356_420 / 88_000_000), True)
    assert "7184 B per token against 85938 without checkpointing" in ratio.note
    assert by["checkpointed_bytes_vs_predicted"].value == pytest.approx(7_356_420 / 7_356_416)
    # paired on / off: 1.2, 1.3, 1.1 -> median 1.2 (the warm-up left out)
    step = by["step_time_ratio"]
    assert (step.value, step.met, step.target.text) == (pytest.approx(1.2), True, "<= 1.35")
    assert "median of 3 paired repetitions in alternating order after 1 warm-up" in step.note
    loss = by["losses_max_rel_diff"]
    assert (loss.value, loss.met) == (0.0, True)


def test_checkpointing_ratios_are_void_when_the_losses_differ():
    rows = {row.metric: row for row in mr.checkpointing_rows(_checkpointing_raw(1e-2))}
    assert rows["losses_max_rel_diff"].met is False
    for metric in ("activation_peak_ratio", "step_time_ratio"):
        assert rows[metric].target is None and rows[metric].met is None
        assert rows[metric].note.startswith("VOID (losses differ): ")
    table = format_table(list(rows.values()))
    assert "VOID (losses differ)" in table


def test_the_three_benches_are_registered_with_their_repetitions():
    for name in ("zero-memory", "activation-checkpointing", "overhead"):
        assert name in BENCHES and name in DEFAULT_REPS
        assert cli.build_parser().parse_args(["bench", name, "--json"]).name == name


def test_zero_memory_runs_resolve_as_pp2_dp2_per_zero_stage():
    from dsnd.bench.zero_memory_rank import ZERO_WORLD, zero_configs, zero_ranks

    runs = zero_configs(ZERO_WORLD, ["model.hidden_size=128"])
    assert sorted(runs) == [0, 1, 2, 3]
    for stage, res in runs.items():
        assert (res.plan.zero_stage, res.topology.pp, res.topology.dp) == (stage, 2, 2)
        assert res.model.hidden_size == 128 and zero_ranks(res) == 2
    assert runs[3].ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_checkpointing_runs_differ_only_in_the_interval():
    from dsnd.bench.checkpointing_rank import checkpointing_configs

    runs = checkpointing_configs()
    off, on = runs["off"], runs["on"]
    assert (
        off.run.parallel.activation_checkpoint_interval,
        on.run.parallel.activation_checkpoint_interval,
    ) == (0, 1)
    assert off.model.describe() == on.model.describe()
    assert (on.model.hidden_size, on.run.model.seq_len, on.topology.world_size) == (256, 512, 1)
    assert (on.batch.micro, on.batch.gas) == (2, 2) and off.ds == on.ds
