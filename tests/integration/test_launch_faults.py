"""Faults through real `dsnd launch` runs across the loopback cluster (tests/cluster.py): two
"hosts" (127.0.0.1, 127.0.0.2) reached over a real sshd, one rank each (pp=2), llama-tiny.

- reference: 20 uninterrupted steps, checkpoints every 3; a secret passed through `launch.env`
  is masked in the launcher's output and appears in no file of the run;
- three faults in one job and its relaunch (each launch across two hosts costs seconds, so the
  faults share them), every step any attempt ran equal to the reference bit for bit:
  - SIGKILL of rank 1 after step 6 with --max-restarts 1 and checkpoint.resume=never: the
    failure line names rank 1 and its host; the job restarts from its own step-6 checkpoint;
  - SIGTERM to the launcher two steps later: every rank stops at the same step, a checkpoint
    is saved there, exit 0;
  - the relaunch resumes there; SIGSTOP of its rank 1 ends it within dist.timeout_s + 10 s,
    naming rank 1; no process left;
- preflight: an unreachable host and a busy rendezvous port are refused before any rank starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cluster import environ_of, processes_with_env
from tests.procs import ROOT, assert_same_steps, free_port, metrics_rows, rank_env

STEPS = 20
STOP_TIMEOUT_S = 12
TIMEOUT = 400
SECRET = "hf_do_not_leak_0123456789"
PASSED = '["OMP_NUM_THREADS","MKL_NUM_THREADS","DS_ACCELERATOR","HF_TOKEN"]'


class Launch:
    """`dsnd launch --hostfile` across the cluster, in its own run directory."""

    def __init__(self, cluster, tmp_path, name: str, *extra: str, steps: int = STEPS):
        self.tag = uuid.uuid4().hex
        self.log_dir = tmp_path / name
        self.root = self.log_dir / "checkpoints"
        hostfile = cluster.hostfile(str(tmp_path / "hosts"), slots=1)
        self.argv = [
            *cluster.prefix,
            sys.executable,
            "-m",
            "dsnd",
            "launch",
            "--hostfile",
            hostfile,
            "--master-port",
            str(free_port()),
            "--set",
            "parallel.pp=2",
            "--set",
            f"train.steps={steps}",
            "--set",
            "checkpoint.every=3",
            "--set",
            f"log.dir={self.log_dir}",
            "--set",
            "log.tensorboard=false",
            "--set",
            f"launch.env={PASSED}",
            *extra,
        ]
        self.env = rank_env({**cluster.env, "DSND_TEST_RUN": self.tag, "HF_TOKEN": SECRET})
        self.proc: subprocess.Popen | None = None

    def start(self) -> Launch:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str, str]:
        assert self.proc is not None
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def run(self) -> tuple[int, str, str]:
        return self.start().finish()

    def rows(self) -> list[dict]:
        return metrics_rows(self.log_dir)

    def wait_for(self, ready, what: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"launch ended before {what}: {self.finish()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.2)

    def rank_pid(self, rank: int, running: bool = True) -> int | None:
        """The pid of the `dsnd train` process of `rank` (wherever its agent started it); None
        when there is none and not `running`, which asks for one."""
        for pid in processes_with_env("DSND_TEST_RUN", self.tag):
            if environ_of(pid).get("RANK") == str(rank):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"dsnd\0train" in f.read():
                        return pid
        assert not running, f"rank {rank} is not running"
        return None

    def leftovers(self) -> list[int]:
        return processes_with_env("DSND_TEST_RUN", self.tag)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    run = Launch(cluster, tmp_path_factory.mktemp("faults"), "reference")
    rc, out, err = run.run()
    assert rc == 0, out[-3000:] + err[-3000:]
    return run, out + err


def test_reference_run_across_two_hosts_masks_its_secret(reference):
    run, output = reference
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert "HF_TOKEN=****" in output and SECRET not in output
    assert sorted(os.listdir(run.root)) == [
        ".dsnd.lock",
        "latest",
        *(f"step_{s:08d}" for s in (*range(3, STEPS, 3), STEPS)),  # and the last
    ]
    for folder, _, files in os.walk(run.log_dir):  # logs, configs, checkpoints
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert SECRET.encode() not in f.read(), os.path.join(folder, name)
    assert run.leftovers() == []


def test_sigkill_restart_then_sigterm_save_then_sigstop_of_the_resumed_job(
    reference, cluster, tmp_path
):
    """Three faults in one job and its relaunch (one launch each, not one per fault), every
    step any attempt ran equal to the reference's bit for bit."""
    want = reference[0].rows()
    timeout = ("--set", f"dist.timeout_s={STOP_TIMEOUT_S}")
    # 1. SIGKILL of rank 1 once step 6 is committed. `never`: no checkpoint from before this
    # job, and the restart still resumes the job's own step 6
    run = Launch(
        cluster,
        tmp_path,
        "faults",
        "--max-restarts",
        "1",
        "--set",
        "checkpoint.resume=never",
        *timeout,
    ).start()
    latest = run.root / "latest"
    run.wait_for(
        lambda: latest.exists() and latest.read_text() == "step_00000006\n", "the step-6 checkpoint"
    )
    killed = run.rank_pid(1)
    os.kill(killed, signal.SIGKILL)
    # 2. SIGTERM to the launcher two steps into the restart: the step it is on is saved, exit 0
    run.wait_for(lambda: run.rank_pid(1, running=False) not in (None, killed), "the restart")
    restarted_at = len(run.rows())  # the killed attempt's rows: its ranks are gone
    run.wait_for(lambda: len(run.rows()) >= restarted_at + 2, "two steps of the restart")
    run.proc.send_signal(signal.SIGTERM)
    rc, out, err = run.finish()
    assert rc == 0, out[-3000:] + err[-3000:]
    assert (
        "dsnd: attempt 1 of 2 failed: rank 1 on host 127.0.0.2 was killed by SIGKILL; "
        "restarting from this job's last committed checkpoint"
    ) in err
    assert f"resumed from {run.root}/step_00000006 at step 6" in out + err
    rows = run.rows()
    stopped = rows[-1]["step"]
    assert 8 <= stopped < STEPS - 3, rows
    assert f"stopped at step {stopped} on request (SIGTERM)" in out + err
    assert latest.read_text() == f"step_{stopped:08d}\n"
    assert_same_steps(rows[:restarted_at], want[:restarted_at])  # 1..6 (or 7)
    assert_same_steps(rows[restarted_at:], want[6:stopped])  # the restart's 7..stopped
    assert run.leftovers() == []
    # 3. the relaunch resumes there; SIGSTOP of its rank 1 ends it within dist.timeout_s + 10 s
    again = Launch(cluster, tmp_path, "faults", *timeout).start()
    again.wait_for(lambda: len(again.rows()) > len(rows), "a step of the relaunch")
    os.kill(again.rank_pid(1), signal.SIGSTOP)
    t0 = time.monotonic()
    rc, out, err = again.finish()
    took = time.monotonic() - t0
    assert rc == 1, out[-3000:] + err[-3000:]
    assert STOP_TIMEOUT_S <= took < STOP_TIMEOUT_S + 10, took
    assert re.fullmatch(
        r"dsnd: job failed: rank 1 on host 127\.0\.0\.2 was stopped \(SIGSTOP "
        rf"or a debugger\) for 1\d s \(dist\.timeout_s={STOP_TIMEOUT_S}\)",
        err.strip().splitlines()[-1],
    ), err
    assert f"resumed from {run.root}/step_{stopped:08d} at step {stopped}" in out + err
    resumed = again.rows()[len(rows) :]
    assert_same_steps(resumed, want[stopped : stopped + len(resumed)])
    assert again.leftovers() == []


def test_preflight_refuses_an_unreachable_host_and_a_busy_port(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # no sshd on 127.0.0.3
    port = free_port()
    listen = (
        "import socket, sys, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(120)"
    )
    busy = subprocess.Popen(
        [*cluster.prefix, sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True
    )
    try:
        assert busy.stdout.readline() == "up\n"  # the port is taken where the hosts are
        proc = subprocess.run(
            [
                *cluster.prefix,
                sys.executable,
                "-m",
                "dsnd",
                "launch",
                "--hostfile",
                str(hostfile),
                "--master-port",
                str(port),
                "--set",
                "parallel.pp=2",
                "--set",
                f"log.dir={tmp_path / 'run'}",
            ],
            cwd=ROOT,
            env=rank_env(cluster.env),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == (
        f"dsnd: error: preflight: host 127.0.0.1: rendezvous port 127.0.0.1:{port} is in use "
        "(pick another with --master-port)"
    )
    assert lines[1].startswith("dsnd: error: preflight: host 127.0.0.3: unreachable: ")
    assert len(lines) == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert os.listdir(tmp_path / "run" / "checkpoints") == []  # the marker file is gone
