"""`dsnd bench overhead`: its rows from hand-made raw JSON, and its baseline (the bench's own plain
PyTorch loop) against the suite's reference loop."""

from __future__ import annotations

import pytest

from dsnd.bench import overhead_results as orr


def _raw(dsnd: list[float], plain: list[float], shift: float = 0.0) -> dict:
    reps = [
        {
            "rep": i,
            "timed": i > 0,
            "order": ["dsnd", "plain"],
            "runs": {
                "dsnd": {"step_s": d, "loss": 5.0 - i + shift},
                "plain": {"step_s": p, "loss": 5.0 - i},
            },
        }
        for i, (d, p) in enumerate(zip(dsnd, plain, strict=True))
    ]
    layout = {
        "model": "llama",
        "batch": "Batch(train=16, micro=2, gas=8)",
        "seq_len": 64,
        "tokens_per_step": 1024,
        "zero_stage": 0,
        "optimizer": "AdamW",
    }
    return {"layout": layout, "reps": reps}


def test_overhead_rows_are_paired_medians():
    # paired plain / dsnd: 0.9, 1.0, 0.8 -> 0.9; dsnd - plain: 10, 0, 20 ms -> 10 (warm-up out)
    raw = _raw(dsnd=[5.0, 0.100, 0.090, 0.100], plain=[1.0, 0.090, 0.090, 0.080])
    rows = {row.metric: row for row in orr.overhead_rows(raw)}
    assert list(rows) == [
        "throughput_ratio",
        "dsnd_overhead_ms_per_step",
        "dsnd_tokens_per_s",
        "plain_tokens_per_s",
        "losses_max_rel_diff",
    ]
    ratio = rows["throughput_ratio"]
    assert (ratio.value, ratio.met, ratio.target.text) == (pytest.approx(0.9), False, ">= 0.95")
    assert "median of 3 paired repetitions in alternating order after 1 warm-up" in ratio.note
    assert rows["dsnd_overhead_ms_per_step"].value == pytest.approx(10.0)
    assert rows["dsnd_tokens_per_s"].value == pytest.approx(1024 / 0.1)
    assert rows["plain_tokens_per_s"].value == pytest.approx(1024 / 0.09)
    assert (rows["losses_max_rel_diff"].value, rows["losses_max_rel_diff"].met) == (0.0, True)
    assert all(row.bench == "overhead" for row in rows.values())


def test_overhead_ratio_is_void_when_the_losses_differ():
    raw = _raw(dsnd=[1.0, 0.1], plain=[1.0, 0.1], shift=0.01)
    rows = {row.metric: row for row in orr.overhead_rows(raw)}
    assert rows["losses_max_rel_diff"].met is False
    assert rows["throughput_ratio"].met is None
    assert rows["throughput_ratio"].note.startswith("VOID (losses differ): ")


def test_the_plain_loop_trains_as_the_reference_loop(tmp_path):
    """The bench's baseline computes what the suite's reference computes (same weights, data,
    optimizer, clipping and schedule): its losses are dsnd's target."""
    from dsnd.bench.overhead_rank import PlainLoop, overhead_config
    from dsnd.data import load_corpus
    from dsnd.data.held_out import split_samples
    from tests.reference import reference_rows

    res = overhead_config(str(tmp_path), ["train.steps=3", "ds.train_batch_size=4"])
    assert (res.topology.world_size, res.topology.pp, res.plan.zero_stage) == (1, 1, 0)
    data = res.run.data
    corpus = load_corpus(data.path, data.format, data.text_field, data.max_bytes)
    plain = PlainLoop(res, split_samples(res.run, corpus).train)
    losses = [plain.step(step) for step in range(3)]
    assert losses == pytest.approx([row["loss"] for row in reference_rows(res)], rel=1e-6)
