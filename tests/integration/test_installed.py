"""The installed package works from any directory: packaged default YAML and DeepSpeed JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.procs import rank_env

DSND = os.path.join(os.path.dirname(sys.executable), "dsnd")


def installed_env() -> dict[str, str]:
    env = rank_env()
    env.pop("PYTHONPATH")  # the installed copy, not the checkout
    return env


def test_console_script_trains_from_an_empty_directory(tmp_path):
    assert os.access(DSND, os.X_OK), "install the project first: pip install '.[test,mpi]'"
    proc = subprocess.run(
        [DSND, "train", "--set", "train.steps=2", "--set", "log.dir=out"],
        cwd=tmp_path,
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    # a default run holds out eval.fraction of the samples and evaluates at its end
    assert "eval_loss" not in rows[0] and 5.0 < rows[1]["eval_loss"] < 5.7
    resolved = json.loads((tmp_path / "out" / "deepspeed.resolved.json").read_text())
    assert resolved["train_batch_size"] == 16 and resolved["train_micro_batch_size_per_gpu"] == 2
    assert resolved["zero_optimization"]["stage"] == 0
    # what a first user reads, in order: the resolved run (batch, precision), the steps, where
    # it all went
    said = [line.split(" INFO ", 1)[1] for line in proc.stderr.splitlines() if " INFO " in line]
    first = [i for i, text in enumerate(said) if text.startswith("training ")]
    batch = said.index(
        "batch: train_batch_size 16 = micro 2 x gradient_accumulation_steps 8 x dp 1 (pp=1, tp=1)"
    )
    precision = said.index("precision: fp32")
    steps = [i for i, text in enumerate(said) if text.startswith("step ")]
    assert first and len(steps) == 2 and first[0] < batch < precision < steps[0], said
    assert said[-1] == (
        "outputs: metrics out/metrics.jsonl, checkpoint "
        "out/checkpoints/step_00000002, TensorBoard out, logs out/logs"
    ), said
