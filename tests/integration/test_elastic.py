"""An elastic job (`dsnd launch --min-hosts 2 --rejoin`) across three loopback hosts, each with
an sshd of its own (tests/cluster.py, `per_host`), 2 ranks each: pp=2 x dp=3, llama-tiny, global
batch 12 (micro-batch 2), 16 steps, a checkpoint every 2.

At step 7 the third host goes down: its sshd is killed, then its agent (its ranks die with it).
The job must go on without it: the restart leaves the host out (ssh refused), runs pp=2 x dp=2 on
the 4 ranks left with 3 accumulation steps instead of 2, and resumes the step-6 checkpoint. Two
steps later the host's sshd comes back: --rejoin sees it answer, the ranks save at the next step,
and the job starts again on all 6 ranks, pp=2 x dp=3, to the end.

Every step (the last run of each) equals the single-process plain-PyTorch reference at the same
global batch within rel 1e-4, loss and gradient norm: the same samples in the same order on every
layout. metrics.jsonl's `run_start` rows say each start's layout and why. No process is left.

And a world no layout fits (elastic.memory_gb) is refused in one line, exit 2, before any rank
starts, the job's newest checkpoint untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cluster import environ_of, processes_with_env, start_cluster
from tests.integration.conftest import ELASTIC_SETS
from tests.procs import ROOT, free_port, metrics_rows, rank_env

STEPS = 16  # ELASTIC_SETS' train.steps
LOST_AT = 7
TIMEOUT = 600
TAG = "DSND_TEST_RUN"
PASSED = '["OMP_NUM_THREADS","MKL_NUM_THREADS","DS_ACCELERATOR","PYTHONPATH","DSND_TEST_RUN"]'
SETS = ELASTIC_SETS


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory):
    c = start_cluster(str(tmp_path_factory.mktemp("elastic_cluster")), nhosts=3, per_host=True)
    yield c
    c.stop()


def _launch(cluster, tmp_path, hostfile: str, *extra: str) -> list[str]:
    return [
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
        f"log.dir={tmp_path / 'log'}",
        "--set",
        f"launch.env={PASSED}",
        *[a for s in SETS for a in ("--set", s)],
        *extra,
    ]


def _ranks_on(tag: str, host: str) -> list[int]:
    """Pids of the job's `dsnd train` ranks started in an ssh session to `host`."""
    found = []
    for pid in processes_with_env(TAG, tag):
        env = environ_of(pid)
        if "RANK" in env and env.get("SSH_CONNECTION", "").split()[2:3] == [host]:
            found.append(pid)
    return found


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _wait(proc, ready, what: str, deadline: float) -> None:
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"launch ended before {what}:\n{out[-3000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.2)


def _last_of_each_step(rows: list[dict]) -> list[dict]:
    final: dict[int, dict] = {}
    for row in rows:
        final[row["step"]] = row
    return [final[s] for s in sorted(final)]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-12)


@pytest.mark.launch
def test_a_lost_host_is_left_out_and_taken_back_with_the_same_losses(
    three_hosts, tmp_path, elastic_reference
):
    cluster, tag = three_hosts, uuid.uuid4().hex
    hostfile = cluster.hostfile(str(tmp_path / "hosts"), slots=2)
    argv = _launch(
        cluster, tmp_path, hostfile, "--min-hosts", "2", "--rejoin", "--max-restarts", "1"
    )
    argv += ["--set", "checkpoint.resume=never", "--set", "dist.timeout_s=30"]
    env = rank_env({**cluster.env, TAG: tag})
    log_dir = tmp_path / "log"
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + TIMEOUT
    out = err = ""
    try:
        _wait(proc, lambda: len(metrics_rows(log_dir)) >= LOST_AT, f"step {LOST_AT}", deadline)
        # the third host goes down: no new ssh session, and its agent (so its ranks) gone
        cluster.stop_host("127.0.0.3")
        agents = {_parent(pid) for pid in _ranks_on(tag, "127.0.0.3")}
        assert len(agents) == 1, agents
        os.kill(agents.pop(), signal.SIGKILL)
        lost_rows = len(metrics_rows(log_dir))
        # a step of the 4-rank attempt, then the host answers again
        _wait(proc, lambda: len(metrics_rows(log_dir)) > lost_rows, "the restart", deadline)
        cluster.start_host("127.0.0.3")
        out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            out, err = proc.communicate()
        (tmp_path / "launch.out").write_text(out)
        (tmp_path / "launch.err").write_text(err)
    assert proc.returncode == 0, out[-4000:] + err[-4000:]
    assert "dsnd: elastic: leaving out host 127.0.0.3" in err, err[-3000:]
    assert "after: the agent on host 127.0.0.3 ended without a report" in err, err[-3000:]
    assert "127.0.0.3 answers again" in err, err[-3000:]
    rows = metrics_rows(log_dir)
    starts = [r["run_start"] for r in rows if "run_start" in r]
    layouts = [(s["layout"]["world"], s["layout"]["pp"], s["layout"]["dp"]) for s in starts]
    assert layouts == [(6, 2, 3), (4, 2, 2), (6, 2, 3)], (starts, out[-3000:], err[-3000:])
    assert starts[1]["resumed_from"].endswith("step_00000006"), starts[1]
    assert "127.0.0.3" in starts[1]["why"] and "--rejoin" in starts[2]["why"], starts
    assert "micro-batch 2 x 3 accumulation x dp 2 = global batch 12" in out, out[-3000:]
    final = _last_of_each_step(rows)
    assert [r["step"] for r in final] == list(range(1, STEPS + 1))
    for got, want in zip(final, elastic_reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert _close(got[key], want[key]), (got["step"], key, got[key], want[key])
    latest = log_dir / "checkpoints" / "latest"
    assert latest.read_text() == f"step_{STEPS:08d}\n"
    time.sleep(1)
    assert processes_with_env(TAG, tag) == []

    # no layout of the 2 ranks one host has fits 1 KiB of model state: refused, nothing lost
    before = sorted(os.listdir(log_dir / "checkpoints"))
    one = tmp_path / "one_host"
    one.write_text("127.0.0.1 slots=2\n")
    argv = _launch(cluster, tmp_path, str(one), "--min-hosts", "1")
    argv += ["--set", "elastic.memory_gb=1e-6", "--set", "train.steps=20"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsnd: error: elastic: no layout of 2 ranks")
    assert "elastic.memory_gb" in lines[0], lines
    assert sorted(os.listdir(log_dir / "checkpoints")) == before
    assert latest.read_text() == f"step_{STEPS:08d}\n"
