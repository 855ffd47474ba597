"""Faults that used to lose work silently, through real `dsnd train` / `dsnd launch --nprocs 2`
runs of llama-tiny on this machine:

- divergence: a huge learning rate makes the loss NaN at step 2; the job stops with one line
  naming the step, exit non-zero, is not restarted, and no checkpoint holds the NaN state;
- restarts keep to the job: `--max-restarts` after a failure before the job's first commit
  starts again from the user's `checkpoint.resume=PATH` (not from random weights), and with
  `never` does not pick up another job's checkpoint in the directory; the launch's working
  directory is deleted before the failure and the restart still happens;
- one writer per checkpoint directory: a second run is refused naming the first; once the first
  is SIGKILLed the directory is free at once; resuming another run's checkpoint (another seed)
  is refused with what differs;
- a read-only checkpoint directory: one line and exit 2 before any step (`dsnd train`) or rank
  (`dsnd launch`), the committed checkpoint untouched;
- the first failure named: a rank whose disk is full (ENOSPC) in a save is named, not the peer
  whose collective then lost its connection; its traceback is in its rank log.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cluster import processes_with_env
from tests.procs import ROOT, metrics_rows, rank_env, run_cli

TIMEOUT = 400
QUIET = ["--set", "log.tensorboard=false", "--set", "dist.timeout_s=60"]


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.strip().splitlines() if line.startswith("dsnd: error")]


def _train(*sets: str, env=None, prefix: list[str] | None = None):
    args = [a for s in sets for a in ("--set", s)]
    if prefix is None:
        return run_cli(["train", *QUIET, *args], timeout=TIMEOUT, env=env)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "dsnd", "train", *QUIET, *args],
        cwd=ROOT,
        env=rank_env(env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


class Launch:
    """`dsnd launch --nprocs 2` in the background, its ranks tagged for finding them."""

    def __init__(self, *sets: str, cwd: str = ROOT, extra: tuple[str, ...] = (), env=None):
        self.tag = uuid.uuid4().hex
        argv = [sys.executable, "-m", "dsnd", "launch", "--nprocs", "2", *extra, *QUIET]
        argv += [a for s in sets for a in ("--set", s)]
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=rank_env({"DSND_TEST_RUN": self.tag, **(env or {})}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=TIMEOUT)
        return self.proc.returncode, out, err

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not ready():
            assert self.proc.poll() is None, f"launch ended before {what}: {self.finish()}"
            assert time.monotonic() < deadline, f"no {what}"
            time.sleep(0.1)

    def kill_rank(self, rank: int) -> None:
        for pid in processes_with_env("DSND_TEST_RUN", self.tag):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsnd\0train" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
                    return
        raise AssertionError(f"rank {rank} is not running")

    def leftovers(self) -> list[int]:
        return processes_with_env("DSND_TEST_RUN", self.tag)


def _verify(path) -> subprocess.CompletedProcess:
    return run_cli(["ckpt", "verify", str(path)], timeout=120)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step `dsnd train` run (log dir with its checkpoints), shared by the cases
    that need a committed checkpoint to start from: each copies it, or only reads it."""
    log_dir = tmp_path_factory.mktemp("two_steps") / "run"
    done = _train("train.steps=2", f"log.dir={log_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return log_dir


def test_divergence_stops_without_a_nan_checkpoint_and_is_not_restarted(tmp_path):
    log_dir = tmp_path / "run"
    run = Launch(
        "parallel.pp=2",
        "train.steps=6",
        "checkpoint.every=1",
        f"log.dir={log_dir}",
        "ds.scheduler.params.warmup_min_lr=1e10",
        "ds.scheduler.params.warmup_max_lr=1e10",
        extra=("--max-restarts", "2"),
    )
    rc, out, err = run.finish()
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "restarting" not in err  # a restart would only diverge again
    lines = _error_lines(err)
    assert lines == [
        "dsnd: error: training diverged at step 2: loss nan, grad_norm nan; stopped "
        "without saving this state (lower the learning rate, then resume from the "
        "last checkpoint)"
    ]
    assert re.fullmatch(
        r"dsnd: job failed: rank [01] on host localhost exited with code 3 "
        r"\(training diverged\)",
        err.strip().splitlines()[-1],
    ), err[-2000:]
    root = log_dir / "checkpoints"
    assert (root / "latest").read_text() == "step_00000001\n"
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "latest",
        "step_00000001",
    ]
    assert _verify(root).returncode == 0
    assert [r["step"] for r in metrics_rows(log_dir)] == [1]
    assert run.leftovers() == []


def test_restart_before_the_first_commit_keeps_to_resume_path_and_never(tmp_path, two_steps):
    # another job's checkpoint at step 2, to fine-tune from (PATH) or to ignore (never)
    given = two_steps / "checkpoints" / "step_00000002"

    # PATH: the launch runs from a directory that is deleted before its rank is killed
    work = tmp_path / "work"
    work.mkdir()
    log_dir = tmp_path / "tuned"
    run = Launch(
        "train.steps=24",
        "checkpoint.every=0",
        f"log.dir={log_dir}",
        f"checkpoint.resume={given}",
        cwd=str(work),
        extra=("--max-restarts", "1"),
    )
    run.wait_for(lambda: len(metrics_rows(log_dir)) >= 2, "step 4")
    shutil.rmtree(work)
    run.kill_rank(1)
    rc, out, err = run.finish()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "dsnd: attempt 1 of 2 failed: rank 1 on host localhost was killed by SIGKILL" in err
    assert (out + err).count(f"resumed from {given} at step 2") == 2, err[-3000:]  # both
    rows = metrics_rows(log_dir)  # the killed attempt's steps 3..k, then the restart's 3..24
    killed, restarted = rows[:-22], rows[-22:]
    assert [r["step"] for r in restarted] == list(range(3, 25))
    assert [r["step"] for r in killed] == list(range(3, 3 + len(killed))) and len(killed) >= 2
    for a, b in zip(killed, restarted, strict=False):  # the same start: the same steps
        assert (a["step"], a["loss"], a["grad_norm"]) == (b["step"], b["loss"], b["grad_norm"])

    # never: the foreign checkpoint stays unused by the restart too
    fresh = tmp_path / "fresh"
    shutil.copytree(two_steps / "checkpoints", fresh / "checkpoints")
    run = Launch(
        "train.steps=24",
        "checkpoint.every=0",
        f"log.dir={fresh}",
        "checkpoint.resume=never",
        extra=("--max-restarts", "1"),
    )
    run.wait_for(lambda: len(metrics_rows(fresh)) >= 2, "step 2")
    run.kill_rank(1)
    rc, out, err = run.finish()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "resumed from" not in out + err
    steps = [r["step"] for r in metrics_rows(fresh)]
    assert steps[-24:] == list(range(1, 25)) and steps.count(1) == 2
    assert run.leftovers() == []


def test_one_writer_per_checkpoint_dir_and_no_silent_resume_of_another_run(tmp_path):
    log_dir = tmp_path / "run"
    first = Launch("train.steps=100000", "checkpoint.every=0", f"log.dir={log_dir}")
    first.wait_for(lambda: len(metrics_rows(log_dir)) >= 1, "step 1")
    second = _train(
        "train.steps=2",
        f"log.dir={tmp_path / 'other'}",
        f"checkpoint.dir={log_dir / 'checkpoints'}",
    )
    assert second.returncode == 2, second.stderr[-3000:]
    [line] = _error_lines(second.stderr)
    assert line.startswith(
        f"dsnd: error: checkpoint.dir {log_dir / 'checkpoints'} is in use by job "
    )
    assert (
        "one run writes to it at a time (wait for it to end, or set another checkpoint.dir)" in line
    )
    first.kill_rank(0)  # the lock's holder: SIGKILL frees the directory at once
    assert first.finish()[0] == 1
    assert first.leftovers() == []
    again = _train("train.steps=2", f"log.dir={log_dir}")
    assert again.returncode == 0, again.stderr[-3000:]

    # another seed finds step 2 with auto: refused, naming what differs; a named path is allowed
    other_seed = _train("train.steps=4", f"log.dir={log_dir}", "train.seed=99")
    assert other_seed.returncode == 2
    [line] = _error_lines(other_seed.stderr)
    assert line == (
        f"dsnd: error: {log_dir}/checkpoints/step_00000002: written by a run with "
        "other settings (train.seed 1234 -> 99); name it in checkpoint.resume to "
        "continue from it anyway, or start fresh with checkpoint.resume=never or "
        "another checkpoint.dir"
    )
    assert [r["step"] for r in metrics_rows(log_dir)][-2:] == [1, 2]  # nothing trained


def _read_only(path) -> list[str]:
    """A command prefix that runs its command with `path` mounted read-only (a mount namespace
    of its own; root can write through file modes, not through a read-only mount)."""
    p = str(path)
    script = f'mount --bind "{p}" "{p}" && mount -o remount,ro,bind "{p}" "{p}" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, "sh"]


@pytest.mark.skipif(os.geteuid() != 0, reason="read-only bind mounts need root")
def test_read_only_checkpoint_dir_is_one_line_before_anything_runs(tmp_path, two_steps):
    log_dir = tmp_path / "run"
    shutil.copytree(two_steps, log_dir)
    root = log_dir / "checkpoints"
    before = sorted(os.listdir(root))
    ro = _train("train.steps=4", f"log.dir={log_dir}", prefix=_read_only(root))
    assert ro.returncode == 2, ro.stderr[-3000:]
    assert ro.stderr.strip().splitlines() == [
        f"dsnd: error: checkpoint.dir {root} is not writable (Read-only file system); nothing "
        "was started"
    ]
    launch = subprocess.run(
        [
            *_read_only(root),
            sys.executable,
            "-m",
            "dsnd",
            "launch",
            "--nprocs",
            "2",
            *QUIET,
            "--set",
            f"log.dir={log_dir}",
            "--set",
            "train.steps=4",
        ],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert launch.returncode == 2, launch.stderr[-3000:]
    assert launch.stderr.strip().splitlines() == [
        f"dsnd: error: preflight: checkpoint directory {root} is not writable here (Read-only "
        "file system)"
    ]
    assert sorted(os.listdir(root)) == before and _verify(root).returncode == 0
    assert [r["step"] for r in metrics_rows(log_dir)] == [1, 2]


def test_the_rank_whose_disk_filled_is_named_not_its_peer(tmp_path):
    log_dir = tmp_path / "run"
    run = Launch(
        "parallel.pp=2",
        "train.steps=4",
        "checkpoint.every=1",
        f"log.dir={log_dir}",
        env={"DSND_FAULT_FULL_DISK_IN_SAVE": "2:1"},
    )
    rc, out, err = run.finish()
    assert rc == 1
    assert err.strip().splitlines()[-1] == (
        "dsnd: job failed: rank 1 on host localhost exited with code 1"
    )
    log1 = (log_dir / "logs" / "rank_00001.log").read_text()
    assert "Traceback" in log1 and "No space left on device" in log1
    assert (log_dir / "checkpoints" / "latest").read_text() == "step_00000001\n"
    # one line from the rank whose disk filled (its peer learnt of it in the save: exit 4), no
    # traceback on the console, and the unfinished checkpoint removed at once
    assert "Traceback" not in err, err[-3000:]
    assert (
        f"dsnd: error: checkpoint step_00000002 not saved: rank 1: No space left on device "
        f"({log_dir}/checkpoints/.tmp-step_00000002); step_00000001 stays latest"
    ) in err, err
    assert sorted(n for n in os.listdir(log_dir / "checkpoints") if not n.startswith(".dsnd")) == [
        "latest",
        "step_00000001",
    ]
    assert run.leftovers() == []


_SAVE_NAN = """
import os, sys, torch
from dsnd.checkpoint.save import save_checkpoint
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.data import load_corpus
from dsnd.distributed.discover import discover
from dsnd.distributed.groups import run_groups
from dsnd.distributed.init import init_world, shutdown
from dsnd.errors import Diverged
from dsnd.pipeline.runner import StageRunner

root = sys.argv[1]
res = resolve(load(None, [f"checkpoint.dir={root}"]), 1)
init_world(discover({}), 60)
groups = run_groups(res)
engine = StageRunner(res, groups).engine
corpus = load_corpus(None)
print(save_checkpoint(engine, res, groups, 1, root, corpus, "j"))
next(engine.module.parameters()).data[0] = float("nan")  # what a bad update would leave
try:
    save_checkpoint(engine, res, groups, 2, root, corpus, "j")
except Diverged as e:
    print(e)
shutdown()
"""


def test_a_state_holding_nan_is_never_committed(tmp_path):
    root = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_NAN, str(root)],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == [
        str(root / "step_00000001"),
        "step 2: the model or optimizer state holds NaN or infinite values; not saved (the last "
        "committed checkpoint stays latest)",
    ]
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]
    assert (root / "latest").read_text() == "step_00000001\n"
