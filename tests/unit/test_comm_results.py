"""The pure halves of `dsnd bench zero-comm | tp-comm`: ring bytes, summaries, theory and rows."""

from __future__ import annotations

import pytest

from dsnd.bench import comm_results as cr
from dsnd.bench.comm_count import Call, sent_bytes, summarize
from dsnd.commands.bench import BENCHES, DEFAULT_REPS

# --- ring bytes and summaries ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "n", "sent"),
    [
        ("all_reduce", 2, 100.0),
        ("all_reduce", 4, 150.0),
        ("all_gather", 4, 75.0),
        ("reduce_scatter", 2, 50.0),
        ("reduce", 4, 75.0),
        ("broadcast", 2, 50.0),
        ("send", 2, 100.0),
        ("recv", 2, 0.0),
        ("all_reduce", 1, 0.0),
    ],
)
def test_ring_bytes_per_rank(op, n, sent):
    assert sent_bytes(op, 100, n) == sent


def test_reduce_scatter_plus_all_gather_send_what_an_all_reduce_sends():
    for n in (2, 3, 8):
        both = sent_bytes("reduce_scatter", 1000, n) + sent_bytes("all_gather", 1000, n)
        assert both == pytest.approx(sent_bytes("all_reduce", 1000, n))


def test_summarize_sums_per_kind_label_and_op():
    calls = [
        Call("all_reduce", 40, 2, (0, 1), "1", "forward/block1"),
        Call("all_reduce", 40, 2, (0, 1), "1", "forward/block1"),
        Call("all_gather", 80, 2, (0, 2), "2", ""),
        Call("send", 12, 2, (0, 1), "0", ""),
        Call("all_reduce", 8, 4, (0, 1, 2, 3), "0", ""),
    ]
    out = summarize(calls, {"dp": [0, 2], "tp": [0, 1], "pp": [0, 1]})
    assert out == [
        {
            "kind": "tp",
            "label": "forward/block1",
            "op": "all_reduce",
            "calls": 2,
            "payload": 80,
            "sent": 80.0,
        },
        {"kind": "dp", "label": "", "op": "all_gather", "calls": 1, "payload": 80, "sent": 40.0},
        {"kind": "tp", "label": "", "op": "send", "calls": 1, "payload": 12, "sent": 12.0},
        {"kind": "other", "label": "", "op": "all_reduce", "calls": 1, "payload": 8, "sent": 12.0},
    ]


# --- zero-comm ------------------------------------------------------------------------------


def test_zero_theory():
    assert cr.allreduce_bytes(1000, 2) == 1000
    assert cr.allreduce_bytes(1000, 4) == 1500
    assert [cr.zero_theory(s) for s in (1, 2, 3)] == [1.0, 1.0, 1.5]
    assert cr.zero_theory(2, multi_rank=True) == 1.5
    assert cr.zero_theory(3, multi_rank=True) == 1.5


PSI = 1000  # bytes of a stage's parameters


def _dp(op: str, payload: float, calls: int = 1, n: int = 2) -> dict:
    return {
        "kind": "dp",
        "label": "",
        "op": op,
        "calls": calls,
        "payload": payload,
        "sent": sent_bytes(op, payload, n),
    }


def _run(
    zero: int,
    steps: list[list[dict]],
    pp: int = 1,
    params: float = PSI / 2,
    losses: tuple = (2.0, 1.5),
) -> dict:
    """A run whose every stage's rank reports `steps[stage]` as its counted step."""
    lay = {"pp": pp, "dp": 2, "tp": 1, "zero": 0 if zero is None else zero}
    ranks = [
        {
            "stage": s,
            "psi_bytes": PSI,
            "steps": [steps[s % len(steps)]],
            "state": {"params": params},
            "losses": list(losses),
        }
        for s in range(pp)
        for _ in range(2)
    ]
    return {"layout": lay, "ranks": ranks}


def _zero_raw(gathers_m2: float = 2, gathers_m8: float = 2) -> dict:
    """Measurements as theory has them: ZeRO-1/2 per-owner reduces + all-gather; ZeRO-3 a
    reduce-scatter and `gathers` x the parameters all-gathered."""
    z12 = [_dp("reduce", PSI, 2), _dp("all_gather", PSI), _dp("all_reduce", 8, 2)]
    z3 = [_dp("reduce_scatter", PSI), _dp("all_gather", 2 * PSI, 3)]
    return {
        "zero": {
            "runs": {
                "zero1": _run(1, [z12]),
                "zero2": _run(2, [z12]),
                "zero3": _run(3, [[_dp("reduce_scatter", PSI), _dp("all_gather", PSI)]]),
                "zero3-no-reuse": _run(3, [z3]),
                "zero2-multi-rank": _run(2, [[_dp("all_reduce", PSI), _dp("all_gather", PSI)]]),
            }
        },
        "zero-pp": {
            "runs": {
                "pp2-zero1-m2": _run(1, [z12], pp=2),
                "pp2-zero2-m2": _run(2, [z12], pp=2),
                "pp2-zero3-m2": _run(3, [[_dp("all_gather", gathers_m2 * PSI)]], pp=2),
                "pp2-zero3-m8": _run(3, [[_dp("all_gather", gathers_m8 * PSI)]], pp=2),
                "pp2-zero3-persist-m2": _run(3, [[_dp("all_gather", PSI)]], pp=2, params=1.5 * PSI),
                "pp2-zero3-persist-m8": _run(3, [[_dp("all_gather", PSI)]], pp=2, params=1.5 * PSI),
                "pp2-zero3-keep-m2": _run(3, [[_dp("all_gather", PSI)]], pp=2),
                "pp2-zero3-keep-m8": _run(3, [[_dp("all_gather", PSI)]], pp=2),
            }
        },
    }


def _by_metric(rows) -> dict:
    return {row.metric: row for row in rows}


def test_zero_rows_meet_their_targets_when_traffic_is_the_theorys():
    rows = _by_metric(cr.zero_rows(_zero_raw()))
    assert rows["zero1 dp bytes / all-reduce"].value == pytest.approx(1.0, abs=0.01)
    assert rows["zero3 dp bytes / all-reduce"].value == pytest.approx(1.0)
    assert rows["zero3-no-reuse dp bytes / all-reduce"].value == pytest.approx(1.5)
    assert rows["zero2-multi-rank dp bytes / all-reduce"].value == pytest.approx(1.5)
    assert rows["pp2-zero2-m2 stage1 dp bytes / all-reduce"].value == pytest.approx(1.0, abs=0.01)
    assert rows["pp2-zero3 stage0 param all-gathers m8 / m2"].value == 1.0
    assert rows["pp2-zero3-persist stage1 params held / stage params"].value == 1.5
    assert rows["pp2-zero3-keep stage0 param all-gathers m8 / m2"].value == 1.0
    assert all(row.met in (True, None) for row in rows.values()), [
        r.metric for r in rows.values() if r.met is False
    ]


def test_zero_rows_flag_gathers_that_grow_with_micro_batches():
    rows = _by_metric(cr.zero_rows(_zero_raw(gathers_m2=4, gathers_m8=16)))
    growth = rows["pp2-zero3 stage1 param all-gathers m8 / m2"]
    assert (growth.value, growth.met) == (4.0, False)
    assert "4.00x the stage's parameters at m=2, 16.00x at m=8" in growth.note


def test_zero_rows_flag_extra_traffic_and_different_losses():
    raw = _zero_raw()
    raw["zero"]["runs"]["zero2"]["ranks"][0]["steps"][0].append(_dp("all_reduce", PSI))
    raw["zero"]["runs"]["zero3"]["ranks"][0]["losses"] = [2.0, 1.6]
    rows = _by_metric(cr.zero_rows(raw))
    assert rows["zero2 dp bytes / all-reduce"].met is False
    assert rows["zero3 losses vs zero1 (max rel diff)"].met is False


# --- tp-comm --------------------------------------------------------------------------------


def test_megatron_block_counts():
    t = cr.tp_theory(layers=3, activation_bytes=100, tokens=10, sequence_parallel=False)
    assert t[("block", "forward", "all_reduce")] == (6, 600)
    assert t[("block", "backward", "all_reduce")] == (6, 600)
    assert t[("embed", "forward", "all_reduce")] == (1, 100)
    assert t[("head", "backward", "all_reduce")] == (1, 100)
    assert t[("loss", "forward", "all_reduce")] == (2, 120)  # 10 fp32 maxima + 20 fp32 sums
    sp = cr.tp_theory(layers=3, activation_bytes=100, tokens=10, sequence_parallel=True)
    for direction in ("forward", "backward"):
        assert sp[("block", direction, "all_gather")] == (6, 600)
        assert sp[("block", direction, "reduce_scatter")] == (6, 600)
    assert ("block", "forward", "all_reduce") not in sp


def _sent(theory: dict, part: str, n: int) -> float:
    return sum(sent_bytes(op, b, n) for (p, _, op), (_, b) in theory.items() if p == part)


def test_sequence_parallelism_sends_the_bytes_of_the_all_reduces_it_replaces():
    plain, sp = cr.tp_theory(4, 100, 10, False), cr.tp_theory(4, 100, 10, True)
    for n in (2, 4):
        assert _sent(sp, "block", n) == pytest.approx(_sent(plain, "block", n))


def test_labels_name_part_and_direction():
    assert cr.part_of("forward/block3") == ("block", "forward")
    assert cr.part_of("backward/head") == ("head", "backward")
    assert cr.part_of("forward/loss") == ("loss", "forward")
    assert cr.part_of("step") == ("step", "")


LAYOUT = {
    "layers": 2,
    "micro": 2,
    "seq_len": 8,
    "hidden": 4,
    "element_bytes": 4,
    "sequence_parallel": False,
    "activation_checkpoint_interval": 0,
}


def _tp_summary(lay: dict) -> list[dict]:
    """The counted step of a run whose collectives are exactly the theory's, plus the step's
    end (left out of the comparison)."""
    tokens = lay["micro"] * lay["seq_len"]
    theory = cr.tp_theory(
        lay["layers"], tokens * lay["hidden"] * 4, tokens, lay["sequence_parallel"]
    )
    out = []
    for (part, direction, op), (calls, payload) in theory.items():
        label = f"{direction}/{'block1' if part == 'block' else part}"
        out.append(
            {
                "kind": "tp",
                "label": label,
                "op": op,
                "calls": calls,
                "payload": payload,
                "sent": sent_bytes(op, payload, 2),
            }
        )
    out.append(
        {"kind": "tp", "label": "step", "op": "all_reduce", "calls": 1, "payload": 8, "sent": 8.0}
    )
    return out


def _tp_raw(**changes) -> dict:
    runs = {}
    for name, sp in (("tp2", False), ("tp2-sp", True)):
        lay = {**LAYOUT, "sequence_parallel": sp, **changes}
        runs[name] = {"layout": lay, "ranks": [{"steps": [_tp_summary(lay)], "losses": [3.0]}]}
    return {"runs": runs}


def test_tp_rows_exact_when_collectives_are_megatrons():
    rows = cr.tp_rows(_tp_raw())
    assert all(row.met is True for row in rows), [r.metric for r in rows if not r.met]
    metrics = {row.metric for row in rows}
    assert "tp2-sp block backward reduce_scatter bytes / theory" in metrics
    assert "tp2 collective calls / theory" in metrics


def test_tp_rows_flag_a_missing_an_extra_and_an_unexpected_collective():
    raw = _tp_raw()
    summary = raw["runs"]["tp2"]["ranks"][0]["steps"][0]
    summary[0]["calls"] += 1  # a third all-reduce in a block's forward
    summary[0]["payload"] += summary[0]["payload"] // 4
    summary.append(
        {
            "kind": "tp",
            "label": "backward/embed",
            "op": "all_gather",
            "calls": 1,
            "payload": 64,
            "sent": 32.0,
        }
    )
    rows = _by_metric(cr.tp_rows(raw))
    assert rows["tp2 block forward all_reduce bytes / theory"].met is False
    assert rows["tp2 embed backward all_gather bytes (unexpected)"].met is False
    assert rows["tp2 collective calls / theory"].met is False
    assert rows["tp2-sp collective calls / theory"].met is True


def test_checkpointed_backward_is_context_not_a_target():
    raw = _tp_raw(activation_checkpoint_interval=1)
    block = raw["runs"]["tp2"]["ranks"][0]["steps"][0][1]
    assert block["label"] == "backward/block1"
    block["calls"], block["payload"] = 6, block["payload"] * 3 // 2  # one recomputed per block
    rows = _by_metric(cr.tp_rows(raw))
    row = rows["tp2 block backward all_reduce bytes / theory"]
    assert (row.value, row.target) == (1.5, None)
    assert "recomputed forward" in row.note
    assert rows["tp2 block forward all_reduce bytes / theory"].met is True


def test_tp_rows_compare_losses_with_the_first_run():
    raw = _tp_raw()
    raw["runs"]["tp2-sp"]["ranks"][0]["losses"] = [3.3]
    row = _by_metric(cr.tp_rows(raw))["tp2-sp losses vs tp2 (max rel diff)"]
    assert row.value == pytest.approx(0.1) and row.met is False


def test_both_benches_are_registered():
    assert BENCHES["zero-comm"][0] == "dsnd.commands.bench_comm:zero_comm"
    assert BENCHES["tp-comm"][0] == "dsnd.commands.bench_comm:tp_comm"
    assert DEFAULT_REPS["zero-comm"] == (1, 1) and DEFAULT_REPS["tp-comm"] == (1, 0)
    assert {row.bench for row in cr.tp_rows(_tp_raw())} == {cr.TP_BENCH}
    assert {row.bench for row in cr.zero_rows(_zero_raw())} == {cr.ZERO_BENCH}
