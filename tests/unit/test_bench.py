"""The pure half of `dsnd bench pipeline`: theory, formulas, byte claims, rows and output.

No processes: the rank program's raw JSON is built by hand here.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from dsnd import cli
from dsnd.bench import partition_results as pr
from dsnd.bench import results as r
from dsnd.bench import rows as rw
from dsnd.bench import schedule_results as sr
from dsnd.commands.bench import PARTITION_SHARE, pp4_reps, share_reps
from dsnd.engine.memory import claim_bytes
from dsnd.plan.schedule import (
    BACKWARD,
    FORWARD,
    UNIT_COST,
    Instr,
    StageRole,
    bubble,
    compute_order,
    one_f_one_b,
    program,
    timeline,
)


def test_median_of_odd_and_even_counts_and_of_nothing():
    assert rw.median([3.0, 1.0, 2.0]) == 2.0
    assert rw.median(x for x in [4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        rw.median([])


@pytest.mark.parametrize(
    ("p", "m", "want"), [(1, 8, 0.0), (2, 8, 1 / 9), (4, 4, 3 / 7), (2, 1, 0.5)]
)
def test_bubble_theory(p, m, want):
    assert r.bubble_theory(p, m) == pytest.approx(want)


def test_bubble_theory_refuses_empty_pipelines():
    with pytest.raises(ValueError):
        r.bubble_theory(0, 8)
    with pytest.raises(ValueError):
        r.bubble_theory(2, 0)


def test_bubble_fraction_counts_receive_waits_and_the_drain():
    # stage 0 took the whole 2.0 s and waited 0.2; stage 1 waited 0.1 and finished 0.2 early
    assert r.bubble_fraction([0.2, 0.1], [2.0, 1.8]) == pytest.approx((0.2 + 0.3) / 4.0)
    with pytest.raises(ValueError):
        r.bubble_fraction([0.1], [1.0, 1.0])
    with pytest.raises(ValueError):
        r.bubble_fraction([0.0], [0.0])


def _timeline(p: int, m: int, fwd: float, bwd: float) -> tuple[list[float], list[float]]:
    """(receive waits, busy end) per stage of 1F1B on an ideal pipeline: each stage takes `fwd`
    and `bwd` per micro-batch, messages are free, a stage blocks only in a receive."""
    lists = [one_f_one_b(p, s, m) for s in range(p)]
    done: dict[tuple[int, Instr], float] = {}
    clock, wait, pos = [0.0] * p, [0.0] * p, [0] * p
    while any(pos[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(lists[s]):
                continue
            a = lists[s][pos[s]]
            dep = None
            if a.op == FORWARD and s > 0:
                dep = (s - 1, a)
            elif a.op == BACKWARD and s < p - 1:
                dep = (s + 1, a)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep]) if dep is not None else clock[s]
            wait[s] += start - clock[s]
            clock[s] = start + (fwd if a.op == FORWARD else bwd)
            done[(s, a)] = clock[s]
            pos[s] += 1
            progressed = True
        assert progressed, "deadlock"
    return wait, clock


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_measured_bubble_equals_theory_on_an_ideal_pipeline(p, m):
    """The bench's measurement (receive waits + drain) reproduces (p-1)/(m+p-1) exactly when
    the theory's assumptions hold, whatever the forward/backward split."""
    wait, busy = _timeline(p, m, fwd=1.0, bwd=2.0)
    assert r.bubble_fraction(wait, busy) == pytest.approx(r.bubble_theory(p, m))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_bubble_theory_is_the_schedules_idle_share(p, m):
    """The schedule's bubble is idle over busy time; the bench's is idle over the whole step."""
    roles = [StageRole(s, p) for s in range(p)]
    rows = timeline([program(one_f_one_b(p, s, m), roles[s]) for s in range(p)], roles)
    idle_over_busy = bubble(rows)
    assert r.bubble_theory(p, m) == pytest.approx(idle_over_busy / (1 + idle_over_busy))


def test_claim_bytes_counts_shared_memory_once_for_the_first_category():
    got = claim_bytes(
        [
            ("params", [(100, 40), (140, 20)]),  # adjacent views of one flat buffer
            ("grads", [(300, 10), (300, 10)]),  # the same tensor listed twice
            ("master", [(120, 40), (0, 0)]),  # half inside params' range; an empty tensor
            ("optimizer", [(500, 8)]),
            ("grads", [(305, 10)]),  # a category may come back; overlaps count once
        ]
    )
    assert got == {"params": 60, "grads": 15, "master": 0, "optimizer": 8}


def test_claim_bytes_partial_overlap_counts_only_new_bytes():
    assert claim_bytes([("a", [(0, 10)]), ("b", [(5, 10), (40, 5)])]) == {"a": 10, "b": 10}
    assert claim_bytes([("a", [(10, 5)]), ("b", [(0, 30)])]) == {"a": 5, "b": 25}


def test_targets():
    assert rw.Target.at_least(1.0).met(1.0) and not rw.Target.at_least(1.0).met(0.99)
    assert rw.Target.at_most(1e-4).met(0.0) and not rw.Target.at_most(1e-4).met(1e-3)
    band = rw.Target.between(0.5, 2.0)
    assert band.met(0.5) and band.met(2.0) and not band.met(2.01) and band.text == "0.5..2"
    near = rw.Target.near(0.7, 0.1)
    assert near.met(0.64) and near.met(0.76) and not near.met(0.62)
    assert near.text == "0.7 ±10%"


def test_row_json_has_the_five_keys_and_an_optional_note():
    row = rw.Row("throughput_ratio", 1.2, rw.Target.at_least(1.0), note="why")
    assert row.as_json() == {
        "bench": "pipeline",
        "metric": "throughput_ratio",
        "value": 1.2,
        "target": ">= 1",
        "met": True,
        "note": "why",
    }
    info = rw.Row("dsnd_tokens_per_s", 3000.0).as_json()
    assert info["target"] is None and info["met"] is None and "note" not in info


def test_format_value():
    assert rw.format_value(1.23456) == "1.235"
    assert rw.format_value(3047296.0) == "3047296"
    assert rw.format_value(3248.16) == "3248"
    assert rw.format_value(1.06e-08) == "1.06e-08"
    assert rw.format_value(12) == "12"


def test_table_is_aligned_with_notes_below():
    rows = [
        rw.Row("throughput_ratio", 1.5, rw.Target.at_least(1.0), note="a note"),
        rw.Row("bubble_ratio", 2.5, rw.Target.between(0.5, 2.0)),
        rw.Row("dsnd_tokens_per_s", 3248.2),
    ]
    lines = rw.format_table(rows).split("\n")
    header, body = lines[0], lines[1:4]
    assert header.split() == ["bench", "metric", "value", "target", "met"]
    value_end = header.index("value") + len("value")
    for line in body:  # numbers right-aligned under "value"
        assert line[value_end - 1] != " "
        assert line[value_end] == " "
    assert body[0].split()[-1] == "yes" and body[1].split()[-1] == "NO"
    assert body[2].split()[-2:] == ["-", "-"]
    assert lines[4:] == ["", "notes:", "  throughput_ratio: a note"]


STAGE_OPS = [{"F": 0.16, "B": 0.32}, {"F": 0.24, "B": 0.4}]  # 8 micro-batches per step


def _instr_s(plan: dict, s: int) -> list[float]:
    """Stage s's instruction seconds as the executor records them: its `STAGE_OPS` / 8 per
    compute instruction, sends and the rest free."""
    ops = STAGE_OPS[min(s, 1)]
    return [ops[op] / 8 if op in ops else 0.0 for op, _, _ in plan["programs"][s]]


def _raw(ours: list[float], theirs: list[float], p: int = 2) -> dict:
    reps = []
    plan = _plan("1f1b", p, 8)
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        pipe = [o, o - 0.1, *[o] * (p - 2)]
        reps.append(
            {
                "rep": i,
                "timed": i > 0,
                "order": "dsnd-first",
                "dsnd": {
                    "step_s": [o, o - 0.01, *[o] * (p - 2)],
                    "stage_s": [o + 0.2] * p,
                    "pipe_s": pipe,
                    "wait_s": [0.05, *[0.0] * (p - 1)],
                    "ops": [STAGE_OPS[min(s, 1)] for s in range(p)],
                    "instr_s": [_instr_s(plan, s) for s in range(p)],
                    "loss": 5.0 + i,
                },
                "deepspeed": {"step_s": [t - 0.01, *[t] * (p - 1)], "loss": 5.0 + i + 1e-6 * i},
            }
        )
    return {
        "layout": {
            "pp": p,
            "dp": 1,
            "micro": 2,
            "gas": 8,
            "seq_len": 64,
            "preset": "llama-tiny",
            "partition": "parameters",
            "tokens_per_step": 1024,
            "warmup": 1,
            "ranks": p,
            "cores": 2,
        },
        "reps": reps,
        "plan": plan,
        "latency_s": 0.001,
    }


def test_pipeline_rows_from_raw_measurements():
    raw = _raw(ours=[9.0, 1.0, 1.0, 2.0], theirs=[9.0, 1.5, 2.0, 2.0])
    rows = {row.metric: row for row in r.pipeline_rows(raw)}
    # warm-up rep 0 left out; paired ratios 1.5, 2.0, 1.0 -> median 1.5
    assert rows["throughput_ratio"].value == pytest.approx(1.5)
    assert rows["throughput_ratio"].met is True
    assert rows["dsnd_tokens_per_s"].value == pytest.approx(1024 / 1.0)
    assert rows["deepspeed_tokens_per_s"].value == pytest.approx(1024 / 2.0)
    assert rows["first_step_loss_rel_diff"].value == 0.0
    assert rows["last_step_loss_rel_diff"].met is None
    theory = 1 / 9
    assert rows["bubble_fraction_theory"].value == pytest.approx(theory)
    # per timed rep with a pipelined part of T: idle = 0.05 (stage 0) + 0.1 (stage 1 drain),
    # over 2T; the reduction and optimizer after it (stage_s) are not the pipeline's
    fractions = [0.15 / (2 * t) for t in (1.0, 1.0, 2.0)]
    assert rows["bubble_fraction_measured"].value == pytest.approx(rw.median(fractions))
    assert rows["bubble_ratio"].value == pytest.approx(rw.median(fractions) / theory)
    assert rows["bubble_ratio"].target.text == "<= 1.1"
    assert rows["throughput_ratio"].target.text == ">= 1.1"
    # replayed at the measured costs: stage 0 F 20 ms, B 40 ms; stage 1 F 30 ms, B 50 ms
    stages = sr.idle_fraction(
        sr.replay(raw["plan"], [{"F": 0.02, "B": 0.04}, {"F": 0.03, "B": 0.05}])
    )
    assert rows["bubble_fraction_stages"].value == pytest.approx(stages)
    assert stages > theory  # the slower stage 1 leaves stage 0 idle in every cycle
    dispatch = [(1.0 - 0.05 - 0.48) / 16, (0.9 - 0.64) / 16]  # rep with T = 1.0 (median)
    priced = sr.idle_fraction(
        sr.replay(raw["plan"], [{"F": 0.02, "B": 0.04}, {"F": 0.03, "B": 0.05}], dispatch, 0.001)
    )
    assert rows["bubble_fraction_timeline"].value == pytest.approx(priced)
    runs = [rep["dsnd"] for rep in raw["reps"][1:]]
    own = rw.median(sr.idle_fraction(sr.replay_run(raw["plan"], run, 0.001)) for run in runs)
    assert rows["bubble_fraction_replay"].value == pytest.approx(own)
    assert rows["bubble_ratio_replay"].value == pytest.approx(rw.median(fractions) / own)
    assert "x 16/16 messages) and 1.000 ms from a send" in rows["bubble_fraction_timeline"].note
    assert not any("zero" in metric for metric in rows)  # ``dsnd bench zero-memory``'s
    first = [row.metric for row in r.pipeline_rows(raw)][:1]
    assert first == ["throughput_ratio"]
    lines = rw.json_lines(r.pipeline_rows(raw)).split("\n")
    assert all(
        set(json.loads(line)) >= {"bench", "metric", "value", "target", "met"} for line in lines
    )


def test_pipeline_rows_need_a_timed_repetition():
    raw = _raw(ours=[1.0], theirs=[1.0])
    with pytest.raises(ValueError, match="no timed repetitions"):
        r.pipeline_rows(raw)


def test_bench_cli_parses_options():
    args = cli.build_parser().parse_args(["bench", "pipeline", "--json", "--micro-batches", "4"])
    assert (args.command, args.name, args.json, args.micro_batches) == (
        "bench",
        "pipeline",
        True,
        4,
    )
    assert (args.steps, args.warmup) == (None, None)  # the bench's own (DEFAULT_REPS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--micro-batches", "0"], "--micro-batches must be >= 1, got 0"),
    ],
)
def test_bench_cli_refuses_bad_numbers_before_starting_ranks(capsys, argv, message):
    assert cli.main(["bench", "pipeline", *argv]) == 2
    assert capsys.readouterr().err == f"dsnd: error: {message}\n"


def test_bench_cli_knows_only_the_pipeline_bench(capsys):
    assert cli.main(["bench", "nothing"]) == 2
    assert "invalid choice: 'nothing'" in capsys.readouterr().err


# --- schedules against 1F1B (raw["schedules"], raw["pp4"]) ----------------------------------


def _plan(name: str, p: int, m: int, v: int = 1) -> dict:
    """A schedule's plan as the rank program records it (`pipeline_rank.plan_record`)."""
    roles = [StageRole(s, p, v) for s in range(p)]
    programs = [program(compute_order(name, p, s, m, v), roles[s]) for s in range(p)]
    return {
        "virtual_stages": v,
        "programs": [[[x.op, x.micro, x.chunk] for x in prog] for prog in programs],
        "roles": [dataclasses.asdict(role) for role in roles],
    }


def _run(
    step: float, pipe: list[float], wait: list[float], ops: list[dict], loss: float = 5.0
) -> dict:
    """One schedule's step as the rank program merges it: per-rank lists, one loss."""
    return {
        "stage_s": [step] * 2,
        "step_s": [step] * 2,
        "pipe_s": pipe,
        "wait_s": wait,
        "optimizer_s": [0.0] * 2,
        "times": [{}] * 2,
        "ops": ops,
        "loss": loss,
    }


ONE_F_ONE_B_OPS = [{"F": 0.5, "B": 1.0}] * 2  # 4 micro-batches: F 0.125 s, B 0.25 s
ZB_OPS = [{"F": 0.5, "I": 0.25, "W": 0.25}] * 2  # F 0.125 s, I = W = 0.0625 s


def _section(pp4: bool = False) -> dict:
    """p=2, m=4: a warm-up repetition (left out) and two timed ones of 1F1B and ZB-H1."""
    base = {
        "1f1b": (9.0, [9.0, 9.0], [0.0, 0.0], ONE_F_ONE_B_OPS),
        "zb-h1": (0.1, [9.0, 9.0], [0.0, 0.0], ZB_OPS),
    }
    warm = {"1f1b": _run(*base["1f1b"], loss=5.0), "zb-h1": _run(*base["zb-h1"], loss=5.00025)}
    timed = [
        {
            "1f1b": _run(1.25, [1.0, 0.875], [0.25, 0.125], ONE_F_ONE_B_OPS),
            "zb-h1": _run(1.0, [1.125, 1.0], [0.25, 0.0], ZB_OPS),
        },
        {
            "1f1b": _run(1.5, [1.0, 0.875], [0.25, 0.125], ONE_F_ONE_B_OPS),
            "zb-h1": _run(1.25, [1.125, 1.0], [0.25, 0.0], ZB_OPS),
        },
    ]
    reps = [
        {"rep": i, "timed": i > 0, "order": list(runs), "runs": runs}
        for i, runs in enumerate([warm, *timed])
    ]
    return {
        "layout": {
            "pp": 2,
            "micro_batches": 4,
            "tokens_per_step": 1024,
            "warmup": 1,
            "ranks": 4 if pp4 else 2,
            "cores": 2,
            "model": "preset llama-tiny",
            "layers": 4,
        },
        "plans": {"1f1b": _plan("1f1b", 2, 4), "zb-h1": _plan("zb-h1", 2, 4)},
        "reps": reps,
    }


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "want"),
    [
        ("1f1b", 2, 8, 1, 1 / 8),
        ("gpipe", 4, 8, 1, 3 / 8),
        ("interleaved-1f1b", 2, 8, 2, 1 / 16),
        ("interleaved-1f1b", 4, 8, 2, 3 / 16),
        ("zb-h1", 2, 8, 1, 1 / 24),
        ("zb-h1", 4, 8, 1, 1 / 8),
    ],
)
def test_unit_bubble_is_the_timeline_at_unit_costs(name, p, m, v, want):
    assert sr.unit_bubble(name, p, m, v) == pytest.approx(want)
    cost = {op: c / v for op, c in UNIT_COST.items()}
    assert sr.predicted_bubble(_plan(name, p, m, v), cost) == pytest.approx(want)


def test_measured_bubble_is_idle_over_busy_of_the_busiest_stage():
    # stage 0 spans 1.0 s, 0.25 of it waiting: busy 0.75; stage 1 busy 0.875 - 0.125 = 0.75
    assert sr.measured_bubble([1.0, 0.875], [0.25, 0.125]) == pytest.approx(1 / 3)
    # the busiest stage (1.0 s busy) sets the denominator, the longest span the makespan
    assert sr.measured_bubble([1.125, 1.0], [0.25, 0.0]) == pytest.approx(0.125)
    assert sr.measured_bubble([2.0], [0.0]) == 0.0
    with pytest.raises(ValueError):
        sr.measured_bubble([1.0, 1.0], [0.0])
    with pytest.raises(ValueError):
        sr.measured_bubble([0.5], [0.5])


def test_per_instruction_costs_from_op_seconds():
    plan = _plan("zb-h1", 2, 4)
    assert [sr.op_counts(p) for p in sr.plan_programs(plan)[0]] == [{"F": 4, "I": 4, "W": 4}] * 2
    runs = [
        _run(
            1.0,
            [1.0, 1.0],
            [0.0, 0.0],
            [{"F": 0.5, "I": 0.0, "W": 1.0}, {"F": 1.0, "I": 0.5, "W": 0.5}],
        ),
        _run(
            1.0,
            [1.0, 1.0],
            [0.0, 0.0],
            [{"F": 1.5, "I": 0.0, "W": 1.0}, {"F": 1.0, "I": 0.5, "W": 0.5}],
        ),
        _run(1.0, [1.0, 1.0], [0.0, 0.0], [{"F": 2.5, "W": 1.0}, {"F": 1.0, "I": 0.5, "W": 0.5}]),
    ]
    # medians over runs per stage (stage 0's F: 0.5, 1.5, 2.5 -> 1.5 over 4 forwards)
    assert sr.stage_op_costs(plan, runs) == [
        {"F": 0.375, "I": 0.0, "W": 0.25},
        {"F": 0.25, "I": 0.125, "W": 0.125},
    ]
    assert sr.op_costs(plan, runs) == {"F": 0.3125, "I": 0.0625, "W": 0.1875}
    assert sr.compute_seconds(runs[0]) == 3.5
    assert sr.per_micro_batch(runs, 4) == [(0.375, 0.25), (0.25, 0.25)]
    assert sr.messages(plan) == [8, 8]
    assert sr.messages(_plan("interleaved-1f1b", 2, 4, 2)) == [24, 24]


def test_predicted_bubble_at_measured_costs():
    # ZB-H1, p=2, m=2, I twice F and W: stage 0  F F . . I I W I I W, stage 1  . F I I F I I W W
    assert sr.predicted_bubble(_plan("zb-h1", 2, 2), {"F": 1.0, "I": 2.0, "W": 1.0}) == 0.25
    # 1F1B's bubble is (p-1)/m whatever F and B cost
    assert sr.predicted_bubble(_plan("1f1b", 2, 4), {"F": 1.0, "B": 3.0}) == 0.25


def test_step_parts_of_the_busiest_stage():
    runs = [
        _run(1.0, [1.125, 1.0], [0.25, 0.0], ZB_OPS),
        _run(1.25, [1.125, 1.0], [0.25, 0.0], [ZB_OPS[0], {"F": 0.5, "I": 0.25}]),
    ]
    # stage 1 is the busiest (1.0 s); it computes 1.0 s, then 0.75 s, the rest is messages
    assert sr.step_parts(runs) == {
        "compute": 0.875,
        "receive waits": 0.0,
        "messages and dispatch": 0.125,
        "reduce, optimizer, loss": 0.125,
    }


def test_schedule_rows_against_1f1b():
    rows = {row.metric: row for row in sr.schedule_rows(_section())}
    assert list(rows) == [
        "1f1b_bubble_ratio",
        "1f1b_bubble_measured",
        "1f1b_bubble_theory",
        "1f1b_bubble_theory_unit",
        "zb-h1_throughput_vs_1f1b",
        "zb-h1_compute_vs_1f1b",
        "zb-h1_first_step_loss_rel_diff",
        "zb-h1_bubble_ratio",
        "zb-h1_bubble_measured",
        "zb-h1_bubble_theory",
        "zb-h1_bubble_theory_unit",
    ]
    # 1F1B: busy 0.75 of a 1.0 s makespan -> 1/3, against (p-1)/m = 1/4 -> 4/3, over 1.15
    assert rows["1f1b_bubble_measured"].value == pytest.approx(1 / 3)
    assert rows["1f1b_bubble_theory"].value == pytest.approx(0.25)
    assert rows["1f1b_bubble_ratio"].value == pytest.approx(4 / 3)
    assert rows["1f1b_bubble_ratio"].met is False
    assert rows["1f1b_bubble_ratio"].target.text == "<= 1.15"
    # ZB-H1: 0.125 measured; at F 0.125, I = W = 0.0625 s the timeline predicts 0.125
    assert rows["zb-h1_bubble_measured"].value == pytest.approx(0.125)
    assert rows["zb-h1_bubble_theory"].value == pytest.approx(0.125)
    assert rows["zb-h1_bubble_ratio"].value == pytest.approx(1.0)
    assert rows["zb-h1_bubble_ratio"].met is True
    assert rows["zb-h1_bubble_theory_unit"].value == pytest.approx(1 / 12)
    assert rows["zb-h1_bubble_theory_unit"].target is None
    # paired step times 1.25 / 1.0 and 1.5 / 1.25 -> median of 1.25 and 1.2 (warm-up left out)
    assert rows["zb-h1_throughput_vs_1f1b"].value == pytest.approx(1.225)
    assert rows["zb-h1_throughput_vs_1f1b"].met is True
    assert rows["zb-h1_compute_vs_1f1b"].value == pytest.approx(2 / 3)  # 2.0 s of 3.0 s
    assert rows["zb-h1_first_step_loss_rel_diff"].value == pytest.approx(5e-5)
    assert rows["zb-h1_first_step_loss_rel_diff"].met is True
    note = rows["zb-h1_throughput_vs_1f1b"].note
    assert "tokens/s of zb-h1 (910) / dsnd 1F1B's (745)" in note
    assert "Sends and receives per stage: [8, 8] vs 1F1B's [8, 8]" in note
    assert "zb-h1 compute 1000.0 + receive waits 0.0 + messages and dispatch 0.0" in note
    assert "F 125.00, I 62.50, W 62.50 ms: the mean over stages" in rows["zb-h1_bubble_ratio"].note
    assert "stage 1: 125.00 / 125.00 vs 125.00 / 250.00" in rows["zb-h1_compute_vs_1f1b"].note


def test_schedule_rows_without_a_bubble_target_below_two_micro_batches_per_stage():
    section = _section()
    section["layout"]["micro_batches"] = 3  # m < 2p (the numbers themselves do not change)
    rows = {row.metric: row for row in sr.schedule_rows(section)}
    assert rows["zb-h1_bubble_ratio"].target is None
    assert rows["zb-h1_throughput_vs_1f1b"].target is not None


def test_pp4_rows_are_bubbles_only_without_targets():
    rows = sr.schedule_rows(_section(pp4=True), prefix="pp4_", compare=False)
    assert [row.metric for row in rows] == [
        f"pp4_{name}_bubble_{what}"
        for name in ("1f1b", "zb-h1")
        for what in ("ratio", "measured", "theory", "theory_unit")
    ]
    assert all(row.target is None for row in rows)
    assert rows[0].value == pytest.approx(4 / 3)
    assert rows[0].note.endswith("; 4 ranks share 2 cores, no target")


def test_pipeline_rows_put_the_schedule_phases_after_the_bubble_rows():
    raw = _raw(ours=[9.0, 1.0, 1.0, 2.0], theirs=[9.0, 1.5, 2.0, 2.0])
    plain = [row.metric for row in r.pipeline_rows(raw)]
    pp4_raw = {
        **_raw(ours=[9.0, 2.0, 2.0], theirs=[9.0, 1.9, 2.4], p=4),
        "schedules": _section(pp4=True),
    }
    raw["schedules"], raw["pp4"] = _section(), pp4_raw
    metrics = [row.metric for row in r.pipeline_rows(raw)]
    schedules = [row.metric for row in sr.schedule_rows(raw["schedules"])]
    pp4 = [f"pp4_{metric}" for metric in plain]
    pp4 += [row.metric for row in sr.schedule_rows(pp4_raw["schedules"], "pp4_", compare=False)]
    assert metrics == plain + schedules + pp4


def test_pp4_against_deepspeed_has_a_throughput_target_and_bubbles_without():
    raw = _raw(ours=[9.0, 1.0], theirs=[9.0, 1.0])
    raw["pp4"] = {
        **_raw(ours=[9.0, 2.0, 2.0], theirs=[9.0, 1.9, 2.4], p=4),
        "schedules": _section(pp4=True),
    }
    rows = {row.metric: row for row in r.pipeline_rows(raw)}
    assert rows["pp4_throughput_ratio"].value == pytest.approx((1.9 / 2 + 2.4 / 2) / 2)
    assert rows["pp4_throughput_ratio"].target == r.THROUGHPUT_TARGET
    assert rows["pp4_throughput_ratio"].note.endswith("; 4 ranks share 2 cores")
    assert rows["pp4_bubble_fraction_theory"].value == pytest.approx(3 / 11)
    assert rows["pp4_bubble_ratio"].target is None
    assert rows["pp4_bubble_ratio"].note.endswith("; 4 ranks share 2 cores, no target")
    assert "x 16/32/32/16 messages" in rows["pp4_bubble_fraction_timeline"].note


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_replay_at_equal_costs_and_free_messages_is_the_theory(p, m):
    stages = sr.replay(_plan("1f1b", p, m), [{"F": 1.0, "B": 2.0}] * p)
    assert sr.idle_fraction(stages) == pytest.approx(r.bubble_theory(p, m))


def test_replay_prices_each_message_on_both_sides_and_in_flight():
    # p=2, m=1: F0, send (d), latency L, recv (d), F1, B1, send (d), L, recv (d), B0
    f, b, d, lat = 1.0, 2.0, 0.5, 0.25
    stages = sr.replay(_plan("1f1b", 2, 1), [{"F": f, "B": b}] * 2, [d, d], lat)
    makespan, busy = 2 * (f + b) + 4 * d + 2 * lat, f + b + 2 * d
    # stage 1's span ends with its send; stage 0's with its backward, the step's last action
    assert stages == [
        pytest.approx((makespan, busy)),
        pytest.approx((2 * f + b + 3 * d + lat, busy)),
    ]
    assert sr.idle_fraction(stages) == pytest.approx((makespan - busy) / makespan)


def test_replay_with_a_slower_last_stage():
    # stage 1 (F 1.5, B 2.5) never starves: stage 0 turns a gradient into the next activation
    # in B + F = 3 < 4. It ends at 1 + 8 * 4 = 33, stage 0 one B later, at 35.
    stages = sr.replay(_plan("1f1b", 2, 8), [{"F": 1.0, "B": 2.0}, {"F": 1.5, "B": 2.5}])
    assert stages == [(35.0, 24.0), (33.0, 32.0)]
    assert sr.idle_fraction(stages) == pytest.approx((11 + 3) / 70)
    with pytest.raises(ValueError):
        sr.idle_fraction([(0.0, 0.0)])


def test_replay_run_takes_each_instruction_as_long_as_it_took():
    plan = _plan("1f1b", 2, 8)

    def run(f: list[float], b: float, between: float = 0.0, recv: float = 0.0) -> dict:
        """Stage 0's F(i) takes f[i], every other compute b, each receive `recv` (no waits),
        sends 0; `between` per pipelined instruction outside them."""
        stages = [
            [
                f[m]
                if (s, op) == (0, "F")
                else b
                if op in ("F", "B")
                else recv
                if op.startswith("recv")
                else 0.0
                for op, m, _ in program
            ]
            for s, program in enumerate(plan["programs"])
        ]
        pipe = [sum(t) + between * (len(t) - 2) for t in stages]  # all but reduce and step
        return {"instr_s": stages, "wait_s": [0.0, 0.0], "pipe_s": pipe}

    steady = sr.replay_run(plan, run([2.0] * 8, 2.0), 0.0)
    assert steady == sr.replay(plan, [{"F": 2.0, "B": 2.0}] * 2)  # sums of the same numbers
    # stage 0's forwards alternate 1 and 3 (the same mean): each slow one makes stage 1 wait,
    # and a fast one cannot give that back
    mixed = sr.replay_run(plan, run([1.0, 3.0] * 4, 2.0), 0.0)
    assert sr.idle_fraction(mixed) > sr.idle_fraction(steady)
    assert sr.replay_run(plan, run([2.0] * 8, 2.0), 0.5)[0][0] > steady[0][0]  # latency
    # time between instructions and a receive's own time are the stage's, like a dispatch
    spaced = sr.replay_run(plan, run([2.0] * 8, 2.0, between=0.5), 0.0)
    assert spaced == [
        pytest.approx(x) for x in sr.replay(plan, [{"F": 2.5, "B": 2.5}] * 2, [0.5, 0.5])
    ]
    assert sr.replay_run(plan, run([2.0] * 8, 2.0, recv=0.5), 0.0)[0][1] == 32.0 + 8 * 0.5


def test_dispatch_seconds_is_what_neither_computes_nor_waits_per_message():
    runs = [
        {"pipe_s": [1.0, 0.9], "wait_s": [0.2, 0.1], "ops": [{"F": 0.2, "B": 0.4}] * 2},
        {"pipe_s": [2.0, 0.9], "wait_s": [0.2, 0.1], "ops": [{"F": 0.2, "B": 0.4}] * 2},
        {"pipe_s": [0.8, 0.9], "wait_s": [0.2, 0.1], "ops": [{"F": 0.2, "B": 0.4}] * 2},
    ]
    assert sr.dispatch_seconds(_plan("1f1b", 2, 8), runs) == pytest.approx([0.2 / 16, 0.2 / 16])


def test_schedule_rows_in_the_table():
    rows = (
        sr.schedule_rows(_section())[4:5] + sr.schedule_rows(_section(pp4=True), "pp4_", False)[:1]
    )
    lines = rw.format_table(rows).split("\n")
    assert lines[1].split() == ["pipeline", "zb-h1_throughput_vs_1f1b", "1.225", ">=", "1", "yes"]
    assert lines[2].split() == ["pipeline", "pp4_1f1b_bubble_ratio", "1.333", "-", "-"]
    assert lines[4].startswith("notes:") and lines[5].startswith("  zb-h1_throughput_vs_1f1b: ")


def test_pp4_phase_runs_a_quarter_of_the_repetitions():
    assert pp4_reps(40, 10) == (10, 3)
    assert pp4_reps(2, 0) == (1, 0)


# --- dsnd bench partition: profile against parameters ---------------------------------------


def test_target_below_is_strict():
    below = rw.Target.below(1.0)
    assert below.text == "< 1"
    assert (below.met(0.999), below.met(1.0), below.met(1.2)) == (True, False, False)
    assert rw.Target.at_most(1.0).met(1.0)  # the other bounds stay inclusive


def _times(forward: float, backward: float) -> dict:
    return {
        "forward": forward,
        "backward": backward,
        "comm": 0.5,
        "optimizer": 0.25,
        "pipeline_wait": 0.125,
    }


def _partition_raw(profile_parts: list[int] | None = None) -> dict:
    """Three layers (embedding 1 ms, block 2 ms, head 4 ms per micro-batch) on two stages, two
    micro-batches per step: parameters puts the embedding alone, profile the head alone."""
    layers = [
        {"name": "Embedding", "params": 100, "seconds": 0.001, "memory_bytes": 0},
        {"name": "Block", "params": 10, "seconds": 0.002, "memory_bytes": 0},
        {"name": "Head", "params": 100, "seconds": 0.004, "memory_bytes": 0},
    ]

    def run(stage_times: list[tuple[float, float]], step_s: list[float]) -> dict:
        return {"times": [_times(f, b) for f, b in stage_times], "step_s": step_s, "loss": 3.0}

    reps = [  # (parameters, profile) per repetition; the first is warm-up
        (run([(9.0, 9.0), (9.0, 9.0)], [50.0, 50.0]), run([(1.0, 1.0), (1.0, 1.0)], [5.0, 5.0])),
        (
            run([(0.001, 0.002), (0.004, 0.008)], [0.020, 0.021]),
            run([(0.002, 0.004), (0.003, 0.005)], [0.015, 0.014]),
        ),
        (
            run([(0.001, 0.001), (0.006, 0.010)], [0.024, 0.024]),
            run([(0.002, 0.002), (0.004, 0.006)], [0.018, 0.018]),
        ),
    ]
    return {
        "layout": {
            "pp": 2,
            "dp": 1,
            "micro": 1,
            "micro_batches": 2,
            "seq_len": 8,
            "model": "preset tiny",
            "vocab_size": 1000,
            "hidden_size": 4,
            "blocks": 1,
            "zero_stage": 0,
            "schedule": "1f1b",
            "memory_cap_gb": None,
            "tokens_per_step": 16,
            "warmup": 1,
            "ranks": 2,
            "cores": 2,
            "threads": 1,
        },
        "layers": layers,
        "parts": {"parameters": [0, 1, 3], "profile": profile_parts or [0, 2, 3]},
        "reps": [
            {
                "rep": i,
                "timed": i > 0,
                "order": ["parameters", "profile"],
                "runs": {"parameters": p, "profile": q},
            }
            for i, (p, q) in enumerate(reps)
        ],
    }


def test_stage_compute_sums_forward_and_backward_per_stage():
    run = {"times": [_times(0.25, 0.5), _times(1.0, 2.0)], "step_s": [4.0, 5.0]}
    assert pr.stage_compute(run) == [0.75, 3.0]
    assert pr.slowest_stage(run) == 3.0
    assert pr.slowest_stage(run, "step_s") == 5.0
    assert pr.stage_sums([0, 1, 3], [1.0, 2.0, 4.0]) == [1.0, 6.0]
    assert pr.stage_sums([0, 2, 3], [1.0, 2.0, 4.0]) == [3.0, 4.0]


def test_layer_kinds_counts_each_kind_in_order():
    layers = [{"name": n} for n in ("Embedding", "Block", "Block", "Norm", "Head")]
    assert pr.layer_kinds(layers, 0, 1) == "layers 0..0 (Embedding)"
    assert pr.layer_kinds(layers, 1, 4) == "layers 1..3 (Block x2, Norm)"


def test_partition_rows_from_hand_made_records():
    rows = pr.partition_rows(_partition_raw())
    by = {row.metric: row for row in rows}
    assert all(row.bench == "partition" for row in rows)
    assert [row.metric for row in rows[:6]] == [
        "partition_slowest_stage_ratio",
        "partition_predicted_slowest_stage_ratio",
        "partition_parameters_slowest_stage_ms",
        "partition_profile_slowest_stage_ms",
        "partition_step_time_ratio",
        "partition_first_step_loss_rel_diff",
    ]
    ratio = by["partition_slowest_stage_ratio"]
    # slowest stage per timed repetition: parameters 12 and 16 ms, profile 8 and 10 ms
    assert ratio.value == pytest.approx((8 / 12 + 10 / 16) / 2, rel=1e-12)
    assert (ratio.target.text, ratio.met) == ("< 1", True)
    assert ratio.note.startswith(
        "profile moved the boundaries (parameters [0, 1, 3], profile [0, 2, 3]). "
    )
    assert "median of 2 paired repetitions in alternating order after 1 warm-up" in ratio.note
    assert (
        "layers 2..2 (Head): 4.00 ms per micro-batch = 67% of parameters' predicted slowest "
        "stage, 57% of all layers' time"
    ) in ratio.note
    assert "0 Embedding 1.00, 1 Block 2.00, 2 Head 4.00" in ratio.note
    promised = by["partition_predicted_slowest_stage_ratio"]
    assert (promised.value, promised.target.text, promised.met) == (
        pytest.approx(4 / 6),
        "< 1",
        True,
    )
    assert "(8.0 vs 12.0 ms per step)" in by["partition_predicted_slowest_stage_ratio"].note
    assert by["partition_parameters_slowest_stage_ms"].value == pytest.approx(14.0)
    assert by["partition_profile_slowest_stage_ms"].value == pytest.approx(9.0)
    assert by["partition_step_time_ratio"].value == pytest.approx((15 / 21 + 18 / 24) / 2)
    assert by["partition_step_time_ratio"].target is None
    loss = by["partition_first_step_loss_rel_diff"]
    assert (loss.value, loss.met) == (0.0, True)
    # (measured, predicted) ms per step: medians of the timed repetitions; 2 x the layer costs
    stages = [
        (
            by[f"partition_{name}_stage{s}_compute_ms"].value,
            by[f"partition_{name}_stage{s}_predicted_ms"].value,
        )
        for name in ("parameters", "profile")
        for s in (0, 1)
    ]
    assert [m for m in by if "_stage" in m and "slowest" not in m] == [
        f"partition_{name}_stage{s}_{what}_ms"
        for name in ("parameters", "profile")
        for s in (0, 1)
        for what in ("compute", "predicted")
    ]
    want = [(2.5, 2.0), (14.0, 12.0), (5.0, 6.0), (9.0, 8.0)]  # parameters 0, 1; profile 0, 1
    assert [pytest.approx(pair) for pair in want] == stages
    assert by["partition_parameters_stage1_compute_ms"].note == (
        "layers 1..2 (Block, Head), 110 parameters; forward + backward ms per step, median; "
        "measured / predicted 1.17"
    )


def test_partition_rows_without_a_target_when_profile_keeps_the_boundaries():
    rows = {row.metric: row for row in pr.partition_rows(_partition_raw([0, 1, 3]))}
    ratio = rows["partition_slowest_stage_ratio"]
    assert (ratio.target, ratio.met) == (None, None)
    assert ratio.note.startswith(
        "NOT EVALUATED: profile chose the same boundaries as parameters ([0, 1, 3])"
    )
    promised = rows["partition_predicted_slowest_stage_ratio"]
    assert (promised.value, promised.met) == (1.0, False)


def test_partition_rows_without_a_target_when_profile_keeps_the_slowest_stage():
    raw = _partition_raw()
    raw["layers"][1]["seconds"] = 0.0  # the head alone is the slowest stage of both splits
    rows = {row.metric: row for row in pr.partition_rows(raw)}
    ratio = rows["partition_slowest_stage_ratio"]
    assert (ratio.target, ratio.met) == (None, None)
    assert ratio.note.startswith(
        "NOT EVALUATED: profile moved the boundaries (parameters [0, 1, 3], profile [0, 2, 3]) "
        "but not its slowest stage's predicted time, so the ratio is noise around 1. "
    )
    assert "(layers 2..2 (Head): 4.00 ms per micro-batch = 100% of parameters' " in ratio.note
    promised = rows["partition_predicted_slowest_stage_ratio"]
    assert (promised.value, promised.met) == (1.0, False)


def test_layer_costs_gives_a_run_of_one_kind_as_a_range():
    ms = [("Embedding", 3.0), ("Block", 1.5), ("Block", 2.25), ("Block", 1.75), ("Head", 40.0)]
    layers = [{"name": name, "seconds": t / 1e3} for name, t in ms]
    assert pr.layer_costs(layers) == ("0 Embedding 3.00, 1..3 Block 1.50-2.25 each, 4 Head 40.00")


def test_partition_rows_need_a_timed_repetition():
    raw = _partition_raw()
    raw["reps"] = raw["reps"][:1]
    with pytest.raises(ValueError, match="no timed repetitions"):
        pr.partition_rows(raw)


def test_bench_cli_partition_takes_run_keys():
    args = cli.build_parser().parse_args(
        ["bench", "partition", "--set", "model.num_layers=8", "--set", "model.seq_len=32"]
    )
    assert (args.name, args.sets, args.steps, args.warmup) == (
        "partition",
        ["model.num_layers=8", "model.seq_len=32"],
        None,
        None,
    )


def test_pipeline_bench_resolves_its_runs_with_the_run_keys():
    from dsnd.bench.pipeline_rank import pipeline_configs, pp4_configs

    runs = pipeline_configs(2, 8, ["model.hidden_size=128"])
    every = [runs["pipe"], *runs["schedules"].values()]
    assert {res.model.hidden_size for res in every} == {128}
    pp4 = pp4_configs(4, 8, ["model.hidden_size=128"])
    every = [pp4["pipe"], *pp4["schedules"].values()]
    assert {(res.model.hidden_size, res.model.num_layers, res.topology.pp) for res in every} == {
        (128, 8, 4)
    }
    assert pp4["pipe"].plan.schedule == "1f1b"


def test_partition_bench_runs_half_of_the_repetitions():
    assert share_reps(40, 10, PARTITION_SHARE) == (20, 5)
    assert share_reps(1, 1, PARTITION_SHARE) == (1, 1)


def test_partition_runs_differ_only_in_the_partition(tmp_path):
    from dsnd.bench.partition_rank import partition_configs

    runs = partition_configs(4, 8, str(tmp_path), ["model.seq_len=16"])
    parameters, profile = runs["parameters"], runs["profile"]
    assert parameters.plan.parts == (0, 1, 3, 6, 7)  # embedding and head alone: 2.05M each
    assert (profile.model.vocab_size, profile.model.hidden_size, profile.model.num_layers) == (
        32000,
        64,
        4,
    )
    assert (profile.topology.pp, profile.topology.dp, profile.batch.gas) == (4, 1, 8)
    assert profile.run.model.seq_len == 16 and profile.plan.zero_stage == 0
    assert len(os.listdir(tmp_path / "profile-cache")) == 2  # the profile's JSON and its lock
    assert parameters.run.parallel.partition == "parameters"
    assert profile.run.parallel.partition == "profile"


def test_gpu_bench_without_cuda_says_skipped_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench measures instead")  # not on CI's CPUs
    assert cli.main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out == "dsnd bench gpu: skipped: torch sees no CUDA device\n"


def test_gpu_kernel_rows_compare_the_kernels_with_the_math_path_here_on_the_cpu():
    """`dsnd bench gpu`'s kernel rows, run on the CPU's kernels (small sizes): the ring block
    kernel and SDPA under the document mask agree with the written-out/math path in fp32."""
    import torch

    from dsnd.bench.kernels import packing_rows, ring_kernel_rows

    cpu = torch.device("cpu")
    rows = {r.metric: r for r in ring_kernel_rows(cpu, torch.float32, 1, tokens=64, head_dim=16)}
    assert rows["ring_kernel_agrees"].value == 1.0, rows["ring_kernel_agrees"].note
    assert rows["ring_kernel_speedup"].value > 0
    rows = {r.metric: r for r in packing_rows(cpu, torch.float32, 1, tokens=64)}
    assert rows["packing_kernel_error"].value <= 1e-5
    assert rows["packing_kernel_speedup"].value > 0


def _checkpoint_raw() -> dict:
    def rep(i: int, mode: str, during: list[float]) -> dict:
        return {
            "rep": i,
            "timed": i > 0,
            "mode": mode,
            "baseline_s": [0.2, 0.2, 0.4, 0.2],  # median 0.2
            "during_s": during,
            "join_s": 0.0,
        }

    layout = {
        "model": "llama",
        "batch": "Batch(train=2, micro=2, gas=1)",
        "seq_len": 32,
        "zero_stage": 0,
        "optimizer": "AdamW",
        "device": "cpu",
        "checkpoint_bytes": 230_000_000,
    }
    reps = [
        rep(0, "sync", [9.0]),  # warm-up: left out
        rep(0, "async", [9.0, 9.0]),
        rep(1, "async", [0.3, 0.2, 0.22, 0.18]),  # mean 0.225: 1.125, 4 steps in flight
        rep(1, "sync", [1.2]),  # 6x a step; the save took 5 steps' time
        rep(2, "sync", [1.0]),  # 5x; 4 steps
        rep(2, "async", [0.4, 0.2]),  # mean 0.3: 1.5, 2 steps
    ]
    return {"layout": layout, "reps": reps}


def test_checkpoint_rows_are_step_ratios_against_steps_without_a_save():
    from dsnd.bench.checkpoint_results import checkpoint_rows

    rows = {row.metric: row for row in checkpoint_rows(_checkpoint_raw())}
    assert list(rows) == [
        "sync_step_ratio",
        "sync_save_steps",
        "async_step_ratio",
        "async_save_steps",
    ]
    assert rows["sync_step_ratio"].value == pytest.approx(5.5)  # median of 6 and 5
    assert rows["sync_save_steps"].value == pytest.approx(4.5)
    assert rows["sync_save_steps"].met
    assert rows["async_step_ratio"].value == pytest.approx((1.125 + 1.5) / 2)
    assert rows["async_step_ratio"].target.text == "<= 1.2" and not rows["async_step_ratio"].met
    assert rows["async_save_steps"].value == 3.0
    assert all(row.bench == "checkpoint" for row in rows.values())
    assert "230 MB per checkpoint" in rows["sync_step_ratio"].note


def test_checkpoint_rows_need_a_timed_save_of_each_mode():
    from dsnd.bench.checkpoint_results import checkpoint_rows

    raw = _checkpoint_raw()
    raw["reps"] = [r for r in raw["reps"] if r["mode"] == "sync"]
    with pytest.raises(ValueError, match="no timed save of each mode"):
        checkpoint_rows(raw)


def test_bench_cli_knows_the_checkpoint_bench():
    from dsnd.commands.bench import BENCHES, DEFAULT_REPS

    assert BENCHES["checkpoint"][0] == "dsnd.commands.bench_memory:checkpoint"
    assert DEFAULT_REPS["checkpoint"] == (3, 1)
