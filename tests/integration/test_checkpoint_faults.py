"""Checkpoints under faults, through real launches: a rank SIGKILLed in the middle of a save,
then a flipped byte, then a run that has nothing left to do.

1. `dsnd launch --nprocs 2` (pp=2) saving every 2 steps; rank 1 kills itself (SIGKILL) during the
   save of step 4, after writing its own files (the DSND_FAULT_KILL_IN_SAVE hook in
   dsnd/checkpoint/save.py). The job fails; step 2 stays committed and `latest`; step 4 exists
   only as a temporary directory.
2. The same command again resumes (checkpoint.resume=auto) from step 2, removes the temporary
   directory, and trains to step 6: steps 3 and 4 equal the killed run's, bit for bit.
3. A flipped byte in the newest checkpoint: `checkpoint.resume=<root>` refuses it (exit 2, the
   file named, before any process group starts; `dsnd launch` before any rank starts); `auto`
   skips it with a warning and resumes from
   the previous one (here on a different layout: one process, pp=1).
4. A checkpoint already at train.steps: exit 0 and a message, nothing trained.
"""

from __future__ import annotations

import os

from tests.procs import free_port, metrics_rows, run_cli

TIMEOUT = 400


def _flip_byte(path: str, offset: int = 200) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_kill_during_save_then_resume_then_corruption(tmp_path):
    log_dir = tmp_path / "run"
    root = log_dir / "checkpoints"
    common = [
        "--set",
        "parallel.pp=2",
        "--set",
        "train.steps=6",
        "--set",
        "checkpoint.every=2",
        "--set",
        f"log.dir={log_dir}",
        "--set",
        "dist.timeout_s=60",
    ]

    def launch(env=None):
        return run_cli(
            ["launch", "--nprocs", "2", "--master-port", str(free_port()), *common],
            timeout=TIMEOUT,
            env=env,
        )

    killed = launch({"DSND_FAULT_KILL_IN_SAVE": "4:1"})
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert sorted(os.listdir(root)) == [
        ".dsnd.lock",
        ".tmp-step_00000004",
        "latest",
        "step_00000002",
    ]
    assert (root / "latest").read_text() == "step_00000002\n"
    first = metrics_rows(log_dir)
    assert [r["step"] for r in first] == [1, 2, 3, 4]

    resumed = launch()
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "removed" in out and ".tmp-step_00000004" in out
    assert f"resumed from {root}/step_00000002 at step 2" in out
    rows = metrics_rows(log_dir)[4:]
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    for again, before in zip(rows[:2], first[2:], strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert again[key] == before[key], (again["step"], key)
    assert sorted(os.listdir(root)) == [
        ".dsnd.lock",
        "latest",
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]

    # a flipped byte in the newest checkpoint's model file
    bad = root / "step_00000006" / "layer_002-model.safetensors"
    _flip_byte(str(bad))
    strict = run_cli(
        [
            "train",
            "--set",
            f"log.dir={log_dir}",
            "--set",
            f"checkpoint.resume={root}",
            "--set",
            "train.steps=8",
        ],
        timeout=TIMEOUT,
    )
    assert strict.returncode == 2
    assert strict.stderr.strip().splitlines()[-1] == (
        f"dsnd: error: {bad}: SHA-256 does not match the manifest (corrupt)"
    )
    assert "Traceback" not in strict.stderr
    refused = run_cli(
        ["launch", "--nprocs", "2", *common, "--set", f"checkpoint.resume={root}"], timeout=TIMEOUT
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == strict.stderr.strip().splitlines()[-1:]
    assert "spawned" not in refused.stdout + refused.stderr  # no rank started

    # auto skips it for step 4, reshaped to one process (pp=1), and trains steps 5..6
    auto = run_cli(
        ["train", "--set", f"log.dir={log_dir}", "--set", "train.steps=6"], timeout=TIMEOUT
    )
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-3000:]
    assert "skipping checkpoint" in auto.stderr and "layer_002-model.safetensors" in auto.stderr
    after = metrics_rows(log_dir)[8:]
    assert [r["step"] for r in after] == [5, 6]
    for got, want in zip(after, rows[2:], strict=True):  # pp=2 -> pp=1: same losses to 1e-4
        assert abs(got["loss"] - want["loss"]) <= 1e-4 * abs(want["loss"]), got["step"]

    # now step 6 is newest again (the auto run saved it); asking for 6 steps trains nothing
    done = run_cli(
        ["train", "--set", f"log.dir={log_dir}", "--set", "train.steps=6"], timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "is at step 6, train.steps=6: nothing to train" in done.stdout
    assert len(metrics_rows(log_dir)) == 10
