"""Asynchronous checkpoints (`checkpoint.async: true`) through real launches, against a
synchronous reference (two launches in all: a launch costs seconds, so the faults share one):

1. reference: `dsnd launch --nprocs 2` (pp=2), synchronous checkpoints every 2 steps.
2. the same run with checkpoint.async and --max-restarts 1, every write slowed by 2 s
   (DSND_FAULT_SLOW_ASYNC_WRITE, dsnd/checkpoint/save.py) so that training runs on while it is
   in flight:
   - rank 1 SIGKILLed while step 4's write is in flight: step 2, committed in the background,
     stays latest; the restart removes the temporary directory and resumes from step 2;
   - SIGTERM to the launcher while the restart's step-4 write is in flight: that write is
     committed, then the stop save, exit 0.
   Every step either attempt ran equals the reference's bit for bit, and every checkpoint both
   runs wrote holds the same bytes (tensors, RNG states, the manifest but for the run's config
   and job id).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from dsnd.checkpoint.save import SLOW_ASYNC_ENV
from dsnd.checkpoint.verify import verify
from tests.cluster import environ_of, processes_with_env
from tests.procs import ROOT, assert_same_steps, free_port, metrics_rows, rank_env, run_cli

STEPS = 10
TIMEOUT = 400
SETS = (
    "parallel.pp=2",
    f"train.steps={STEPS}",
    "checkpoint.every=2",
    "log.tensorboard=false",
    "ds.train_batch_size=2",
    "ds.gradient_accumulation_steps=null",
    "eval.fraction=0",
    "dist.timeout_s=30",
)


def _argv(log_dir, *sets: str) -> list[str]:
    items = (*SETS, f"log.dir={log_dir}", *sets)
    return ["launch", "--nprocs", "2", "--master-port", str(free_port())] + [
        a for s in items for a in ("--set", s)
    ]


def _wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not ready():
        assert proc.poll() is None, f"the launch ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {TIMEOUT} s"
        time.sleep(0.05)


def _rank_pid(tag: str, rank: int) -> int | None:
    for pid in processes_with_env("DSND_TEST_RUN", tag):
        if environ_of(pid).get("RANK") == str(rank):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsnd\0train" in f.read():
                    return pid
    return None


def _rng(path: str) -> dict:
    """An RNG file's torch generators: Python's and numpy's are seeded from the OS in each
    process (dsnd seeds torch alone), so two runs' differ from their start."""
    with open(path) as f:
        return {k: v for k, v in json.load(f).items() if k not in ("python", "numpy")}


def _same_checkpoint(got: str, want: str, rng: bool) -> None:
    """The same tensor files byte for byte, the same manifest but for the run's config, its job
    and the RNG files' checksums, and (`rng`) the same torch RNG states. (A resumed run's torch
    state differs from its checkpoint's after its first step, synchronous or not: something
    draws once per process. The losses do not depend on it.)"""
    names = sorted(os.listdir(got))
    assert names == sorted(os.listdir(want))
    for name in names:
        if name.endswith(".safetensors"):
            with (
                open(os.path.join(got, name), "rb") as a,
                open(os.path.join(want, name), "rb") as b,
            ):
                assert a.read() == b.read(), name
    for name in os.listdir(os.path.join(got, "rng")) if rng else ():
        assert _rng(os.path.join(got, "rng", name)) == _rng(os.path.join(want, "rng", name))
    manifests = []
    for folder in (got, want):
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
        manifest["files"] = {k: v for k, v in manifest["files"].items() if "rng" not in k}
        manifests.append({k: v for k, v in manifest.items() if k not in ("config", "job_id")})
    assert manifests[0] == manifests[1]


def test_async_checkpoints_survive_sigkill_and_sigterm_mid_write_and_resume_exactly(tmp_path):
    ref = run_cli(_argv(tmp_path / "sync"), timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    want = metrics_rows(tmp_path / "sync")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))

    log_dir, tag = tmp_path / "async", uuid.uuid4().hex
    root = log_dir / "checkpoints"
    argv = _argv(log_dir, "checkpoint.async=true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsnd", *argv[:1], "--max-restarts", "1", *argv[1:]],
        cwd=ROOT,
        env=rank_env({"DSND_TEST_RUN": tag, SLOW_ASYNC_ENV: "2"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # 1. step 5 trained: every rank is past step 4's save, whose writes sleep 2 s
        _wait_for(proc, lambda: len(metrics_rows(log_dir)) >= 5, "step 5")
        killed = _rank_pid(tag, 1)
        os.kill(killed, signal.SIGKILL)
        assert (root / ".tmp-step_00000004").is_dir()
        assert (root / "latest").read_text() == "step_00000002\n"
        # 2. the restart: SIGTERM once it is past its own step-4 save
        _wait_for(proc, lambda: _rank_pid(tag, 1) not in (None, killed), "the restart")
        first = len(metrics_rows(log_dir))  # the killed attempt's rows: its ranks are gone
        _wait_for(proc, lambda: len(metrics_rows(log_dir)) >= first + 3, "step 5 of the restart")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    said = out + err
    assert proc.returncode == 0, said[-4000:]
    assert "was killed by SIGKILL" in said and "removed" in said and ".tmp-step_00000004" in said
    assert f"resumed from {root}/step_00000002 at step 2" in said
    rows = metrics_rows(log_dir)
    stopped = rows[-1]["step"]
    assert 5 <= stopped < STEPS, rows[-1]
    # the write in flight committed, then the stop save
    order = [
        said.index(f"checkpoint {root}/step_00000004 committed"),
        said.index(f"stopped at step {stopped} on request (SIGTERM)"),
        said.index(f"checkpoint {root}/step_{stopped:08d} committed"),
    ]
    assert order == sorted(order), said[-4000:]
    assert (root / "latest").read_text() == f"step_{stopped:08d}\n"
    assert not [name for name in os.listdir(root) if name.startswith(".tmp-")]
    assert_same_steps(rows[:first], want[:first])
    assert_same_steps(rows[first:], want[2:stopped])
    for step in sorted({2, 4, stopped}):
        got = str(root / f"step_{step:08d}")
        assert verify(got) == []
        if step % 2 == 0:
            sync = str(tmp_path / "sync" / "checkpoints" / f"step_{step:08d}")
            _same_checkpoint(got, sync, rng=step == 2)  # step 2: not resumed
