"""Real launches: `dsnd launch --nprocs`, `mpirun -np 4 dsnd train`, `deepspeed --hostfile`
(one host, `localhost slots=4`) with launch/train.py, stopped by SIGTERM to DeepSpeed's runner.
Every launcher trains the same global batch, so all give the same losses.
pp=2 x dp=2 at ZeRO-3 through real launchers, against the single-process reference: test_slurm.py
(srun across two Slurm nodes) and test_torchrun.py (two torchrun agents)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from dsnd.checkpoint.verify import verify
from tests.cluster import processes_with_env
from tests.procs import ROOT, free_port, metrics_rows, rank_env, run_cli

BIN = os.path.dirname(sys.executable)
TIMEOUT = 400
TAG = "DSND_TEST_LAUNCHERS"
STOP_STEPS = 200  # the runner's job would run this many steps: its ranks must stop long before
# how long a process of the job may outlive the runner: one step, the save, the ranks' teardown
# and launch.py's (measured 6-26 s on 2 busy cores, load 6)
ORPHAN_S = 60.0


def check_rows(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["grad_norm"] > 0


def tool(name: str) -> str:
    path = os.path.join(BIN, name)
    found = path if os.access(path, os.X_OK) else shutil.which(name)
    assert found, f"{name} is not installed (pip install '.[mpi]' provides mpirun)"
    return found


def train_three_steps_like(argv: list[str], log_dir, reference: list[dict]) -> None:
    """Run a launcher command training 3 steps into `log_dir`; its losses must equal
    `reference`'s first three (same global batch, whatever the launcher and rank count)."""
    argv = [*argv, "--set", "train.steps=3", "--set", f"log.dir={log_dir}"]
    proc = subprocess.run(
        argv, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics_rows(log_dir)
    check_rows(rows, 3)
    for got, want in zip(rows, reference[:3], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


@pytest.fixture(scope="module")
def nprocs2_launch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log_dir = tmp_path_factory.mktemp("launch") / "log"
    proc = run_cli(
        [
            "launch",
            "--nprocs",
            "2",
            "--master-port",
            str(free_port()),
            "--set",
            "train.steps=10",
            "--set",
            "ds.zero_optimization.stage=3",
            "--set",
            f"log.dir={log_dir}",
        ],
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, metrics_rows(log_dir)


@pytest.fixture(scope="module")
def nprocs2_zero3(nprocs2_launch) -> list[dict]:
    return nprocs2_launch[1]


@pytest.mark.launch
def test_dsnd_launch_two_ranks_zero3_trains(nprocs2_zero3):
    check_rows(nprocs2_zero3, 10)
    first, last = nprocs2_zero3[0]["loss"], nprocs2_zero3[-1]["loss"]
    assert last < first - 0.5, f"loss did not fall: {first} -> {last}"


@pytest.mark.launch
def test_dsnd_launch_says_nothing_per_rank_about_deepspeeds_start(nprocs2_launch):
    """DeepSpeed printed "... built successfully" (a build or only a load) and warned about its
    warmup scheduler's start from every rank of every run."""
    proc, _ = nprocs2_launch
    said = proc.stdout + proc.stderr
    assert "built successfully" not in said and "before it has started" not in said, said
    assert said.count("step 10/10 ") == 1  # rank 0's progress, the run itself as before


@pytest.mark.launch
def test_mpirun_four_ranks_matches_dsnd_launch(tmp_path, nprocs2_zero3):
    log_dir = tmp_path / "log"
    argv = [
        tool("mpirun"),
        "-np",
        "4",
        "--oversubscribe",
        "-x",
        "MASTER_ADDR=127.0.0.1",
        "-x",
        f"MASTER_PORT={free_port()}",
        "-x",
        "OMP_NUM_THREADS=1",
        "-x",
        "PYTHONPATH",
        "-x",
        "DS_ACCELERATOR",
    ]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    argv += [sys.executable, "-m", "dsnd", "train"]
    train_three_steps_like(argv, log_dir, nprocs2_zero3)


def _sigterm_at_step(runner: subprocess.Popen, log_dir, step: int, out) -> tuple[int, float]:
    """SIGTERM to `runner` once rank 0 logged `step`: the steps logged then, and when the runner
    had exited (monotonic)."""
    deadline = time.monotonic() + TIMEOUT
    while len(metrics_rows(log_dir)) < step:
        assert runner.poll() is None, out.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no step {step} after {TIMEOUT} s"
        time.sleep(0.05)
    logged = len(metrics_rows(log_dir))
    runner.send_signal(signal.SIGTERM)
    runner.wait(timeout=60)
    return logged, time.monotonic()


def _outliving(tag: str, since: float, within_s: float) -> tuple[list[int], float]:
    """The processes carrying `tag` still alive `within_s` after `since` (SIGKILLed then), and
    how long after `since` the last of them was seen."""
    while (left := processes_with_env(TAG, tag)) and time.monotonic() - since < within_s:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left, time.monotonic() - since


@pytest.mark.launch
def test_sigterm_to_deepspeed_hostfile_runner_saves_and_ends_every_rank(
    cluster, tmp_path, nprocs2_zero3
):
    """`deepspeed --hostfile` as users run it on one machine: a hostfile naming `localhost` (the
    runner checks that ssh to it needs no password, even for one host: here the cluster's sshd),
    4 ranks of launch/train.py. SIGTERM to the runner alone at step 3: DeepSpeed's one-host runner
    exits without passing it on, and its launch.py and ranks trained on as orphans. Now each rank
    sees its launcher gone (`dsnd.distributed.launcher_watch`): all stop after one same step and
    commit a checkpoint there, and no process of the job outlives the runner by ORPHAN_S."""
    log_dir, tag, out = tmp_path / "log", uuid.uuid4().hex, tmp_path / "runner.out"
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    argv = [
        *cluster.prefix,
        tool("deepspeed"),
        "--hostfile",
        str(tmp_path / "hosts"),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "launch/train.py",
        "--set",
        f"train.steps={STOP_STEPS}",
        "--set",
        f"log.dir={log_dir}",
    ]
    with open(out, "w") as sink:
        runner = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=rank_env({**cluster.env, TAG: tag}),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    logged, ended = 0, None
    try:
        logged, ended = _sigterm_at_step(runner, log_dir, 3, out)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        left, lived = _outliving(tag, ended or time.monotonic(), ORPHAN_S if ended else 0)
    text, rows = out.read_text(), metrics_rows(log_dir)
    assert runner.returncode == -signal.SIGTERM, text[-3000:]  # DeepSpeed's runner: no handler
    assert not left, f"alive {ORPHAN_S} s after the runner: {left}\n{text[-3000:]}"
    stopped = rows[-1]["step"]
    print(
        f"runner signalled after step {logged}: ranks stopped after step {stopped}, the "
        f"job's last process ended {lived:.1f} s after the runner"
    )
    # rank 0 was in step logged + 1 (perhaps past its flag, in that step's gather): the stop comes
    # at the next boundary, one more if the runner died after it
    assert logged < stopped <= logged + 3, (logged, stopped)
    assert f"stopped at step {stopped} on request (launcher pid " in text, text[-3000:]
    latest = (log_dir / "checkpoints" / "latest").read_text()
    assert latest == f"step_{stopped:08d}\n"
    assert verify(str(log_dir / "checkpoints" / latest.strip())) == []
    check_rows(rows, stopped)
    for got, want in zip(rows[:10], nprocs2_zero3, strict=False):  # same global batch, losses
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert (log_dir / "config.yaml").is_file() and (log_dir / "deepspeed.json").is_file()
    saved = json.loads((log_dir / "deepspeed.resolved.json").read_text())
    assert saved["gradient_accumulation_steps"] == 2  # 16 = 2 micro x 2 accumulation x 4 ranks
