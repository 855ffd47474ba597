"""The pure half of `dsnd bench pipeline`: theory, formulas, byte claims, rows and output.

No processes: the rank program's raw JSON is built by hand here.
"""

from __future__ import annotations

import json

import pytest

from dsnd import cli
from dsnd.bench import results as r
from dsnd.engine.memory import claim_bytes
from dsnd.plan.schedule import (
    BACKWARD,
    FORWARD,
    Instr,
    StageRole,
    bubble,
    one_f_one_b,
    program,
    timeline,
)


def test_median_of_odd_and_even_counts_and_of_nothing():
    assert r.median([3.0, 1.0, 2.0]) == 2.0
    assert r.median(x for x in [4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        r.median([])


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


def test_zero_formulas_in_fp32():
    psi, nd = 1000, 2
    z1 = r.zero_state_bytes(1, psi, nd)
    z3 = r.zero_state_bytes(3, psi, nd)
    assert z1 == {"params": 4000, "grads": 4000, "master": 2000, "adam": 4000}  # 4+4+12/Nd
    assert z3 == {"params": 2000, "grads": 2000, "master": 2000, "adam": 4000}  # 20/Nd
    assert sum(z3.values()) / sum(z1.values()) == pytest.approx(10 / 14)
    t1 = sum(r.zero_state_bytes(1, psi, nd, r.TEXTBOOK_FP32).values())
    t3 = sum(r.zero_state_bytes(3, psi, nd, r.TEXTBOOK_FP32).values())
    assert (t1, t3) == (12000, 8000)
    with pytest.raises(ValueError):
        r.zero_state_bytes(2, psi, nd)
    with pytest.raises(ValueError):
        r.zero_state_bytes(1, psi, 0)


def test_zero3_formula_ratio_falls_with_more_ranks():
    ratios = [
        sum(r.zero_state_bytes(3, 10, nd).values()) / sum(r.zero_state_bytes(1, 10, nd).values())
        for nd in (1, 2, 4, 8)
    ]
    assert ratios[0] == pytest.approx(1.0)  # one rank: nothing to partition
    assert ratios == sorted(ratios, reverse=True)


def test_claim_bytes_counts_shared_memory_once_for_the_first_category():
    got = claim_bytes(
        [
            ("params", [(100, 40), (140, 20)]),  # adjacent views of one flat buffer
            ("grads", [(300, 10), (300, 10)]),  # the same tensor listed twice
            ("master", [(120, 40), (0, 0)]),  # half inside params' range; an empty tensor
            ("adam", [(500, 8)]),
            ("grads", [(305, 10)]),  # a category may come back; overlaps count once
        ]
    )
    assert got == {"params": 60, "grads": 15, "master": 0, "adam": 8}


def test_claim_bytes_partial_overlap_counts_only_new_bytes():
    assert claim_bytes([("a", [(0, 10)]), ("b", [(5, 10), (40, 5)])]) == {"a": 10, "b": 10}
    assert claim_bytes([("a", [(10, 5)]), ("b", [(0, 30)])]) == {"a": 5, "b": 25}


def test_targets():
    assert r.Target.at_least(1.0).met(1.0) and not r.Target.at_least(1.0).met(0.99)
    assert r.Target.at_most(1e-4).met(0.0) and not r.Target.at_most(1e-4).met(1e-3)
    band = r.Target.between(0.5, 2.0)
    assert band.met(0.5) and band.met(2.0) and not band.met(2.01) and band.text == "0.5..2"
    near = r.Target.near(0.7, 0.1)
    assert near.met(0.64) and near.met(0.76) and not near.met(0.62)
    assert near.text == "0.7 ±10%"


def test_row_json_has_the_five_keys_and_an_optional_note():
    row = r.Row("throughput_ratio", 1.2, r.Target.at_least(1.0), note="why")
    assert row.as_json() == {"bench": "pipeline", "metric": "throughput_ratio", "value": 1.2,
                             "target": ">= 1", "met": True, "note": "why"}  # fmt: skip
    info = r.Row("dsnd_tokens_per_s", 3000.0).as_json()
    assert info["target"] is None and info["met"] is None and "note" not in info


def test_format_value():
    assert r.format_value(1.23456) == "1.235"
    assert r.format_value(3047296.0) == "3047296"
    assert r.format_value(3248.16) == "3248"
    assert r.format_value(1.06e-08) == "1.06e-08"
    assert r.format_value(12) == "12"


def test_table_is_aligned_with_notes_below():
    rows = [
        r.Row("throughput_ratio", 1.5, r.Target.at_least(1.0), note="a note"),
        r.Row("bubble_ratio", 2.5, r.Target.between(0.5, 2.0)),
        r.Row("dsnd_tokens_per_s", 3248.2),
    ]
    lines = r.format_table(rows).split("\n")
    header, body = lines[0], lines[1:4]
    assert header.split() == ["bench", "metric", "value", "target", "met"]
    value_end = header.index("value") + len("value")
    for line in body:  # numbers right-aligned under "value"
        assert line[value_end - 1] != " "
        assert line[value_end] == " "
    assert body[0].split()[-1] == "yes" and body[1].split()[-1] == "NO"
    assert body[2].split()[-2:] == ["-", "-"]
    assert lines[4:] == ["", "notes:", "  throughput_ratio: a note"]


def _raw(ours: list[float], theirs: list[float]) -> dict:
    reps = []
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        reps.append({
            "rep": i, "timed": i > 0, "order": "dsnd-first",
            "dsnd": {"step_s": [o, o - 0.01], "stage_s": [o, o - 0.1], "wait_s": [0.05, 0.0],
                     "loss": 5.0 + i},
            "deepspeed": {"step_s": [t - 0.01, t], "loss": 5.0 + i + 1e-6 * i},
        })  # fmt: skip
    psi = 1000
    z1 = {"params": 4000, "grads": 4000, "master": 2000, "adam": 4000}
    z3 = {"params": 2000, "grads": 2000, "master": 2000, "adam": 4000}
    return {
        "layout": {
            "pp": 2,
            "dp": 1,
            "micro": 2,
            "gas": 8,
            "seq_len": 64,
            "preset": "llama-tiny",
            "partition": "parameters",
            "tokens_per_step": 1024,
            "warmup": 1,
        },  # fmt: skip
        "reps": reps,
        "zero": {"psi": psi, "nd": 2, "1": [z1, {**z1, "master": 1900}], "3": [z3, z3]},
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
    # per timed rep with step T: idle = 0.05 (stage 0) + 0.1 (stage 1 drain), over 2T
    fractions = [0.15 / (2 * t) for t in (1.0, 1.0, 2.0)]
    assert rows["bubble_fraction_measured"].value == pytest.approx(r.median(fractions))
    assert rows["bubble_ratio"].value == pytest.approx(r.median(fractions) / theory)
    # the larger rank's total bounds memory: 14000 (rank 0) vs 13900
    assert rows["zero1_state_bytes"].value == 14000
    assert rows["zero3_state_bytes"].value == 10000
    assert rows["zero3_state_bytes_ratio"].value == pytest.approx(10 / 14)
    assert rows["zero3_state_bytes_ratio"].met is True
    assert rows["zero3_state_bytes_ratio_textbook"].value == pytest.approx(8 / 12)
    first = [row.metric for row in r.pipeline_rows(raw)][:1]
    assert first == ["throughput_ratio"]
    lines = r.json_lines(r.pipeline_rows(raw)).split("\n")
    assert all(set(json.loads(line)) >= {"bench", "metric", "value", "target", "met"}
               for line in lines)  # fmt: skip


def test_pipeline_rows_need_a_timed_repetition():
    raw = _raw(ours=[1.0], theirs=[1.0])
    with pytest.raises(ValueError, match="no timed repetitions"):
        r.pipeline_rows(raw)


def test_bench_cli_parses_options():
    args = cli.build_parser().parse_args(["bench", "pipeline", "--json", "--micro-batches", "4"])
    assert (args.command, args.name, args.json, args.micro_batches) == ("bench", "pipeline",
                                                                       True, 4)  # fmt: skip
    assert (args.steps, args.warmup) == (40, 10)


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
