"""``dsnd plan --validate`` on this machine: two ZeRO-3 layouts of llama-tiny on 2 ranks (pp=1 x
dp=2 and pp=2 x dp=1) run through ``dsnd train``; the planner's memory per device is within 15%
of what their ranks measured. Time ratios are printed, not asserted (timings on this shared
machine are a benchmark's business): the first is 1 by construction (the calibration)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FIXED = (
    "tp=1",
    "cp=1",
    "micro_batch=1",
    "activation_checkpointing=false",
    "schedule=1f1b",
    "zero_stage=3",
)


@pytest.mark.dist
def test_validate_memory_within_15_percent():
    argv = [
        sys.executable,
        "-m",
        "dsnd",
        "plan",
        "--model",
        "llama-tiny",
        "--world",
        "2",
        "--gpu",
        "cpu",
        "--seq",
        "64",
        "--global-batch",
        "8",
        "--validate",
        "2",
        "--steps",
        "3",
        "--json",
        *(f"--fix={item}" for item in FIXED),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["validation"]
    assert {(r["pp"], r["dp"]) for r in rows} == {(1, 2), (2, 1)}
    for row in rows:
        print(row["layout"], row["memory_ratio"], row["time_ratio"])
        assert 0.85 <= row["memory_ratio"] <= 1.15, row
        assert row["time_ratio"] > 0
    assert rows[0]["time_ratio"] == pytest.approx(1.0)
