"""Real launches: `dsnd launch --nprocs`, `mpirun -np 4 dsnd train`, `deepspeed --num_gpus 4
launch/train.py`. Every launcher trains the same global batch, so all give the same losses.
pp=2 x dp=2 at ZeRO-3 through real launchers, against the single-process reference: test_slurm.py
(srun across two Slurm nodes) and test_torchrun.py (two torchrun agents)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.procs import ROOT, free_port, metrics_rows, rank_env, run_cli

BIN = os.path.dirname(sys.executable)
TIMEOUT = 400


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
    proc = subprocess.run(argv, cwd=ROOT, env=rank_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics_rows(log_dir)
    check_rows(rows, 3)
    for got, want in zip(rows, reference[:3], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


@pytest.fixture(scope="module")
def nprocs2_launch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log_dir = tmp_path_factory.mktemp("launch") / "log"
    proc = run_cli(["launch", "--nprocs", "2", "--master-port", str(free_port()),
                    "--set", "train.steps=10", "--set", "ds.zero_optimization.stage=3",
                    "--set", f"log.dir={log_dir}"], timeout=TIMEOUT)  # fmt: skip
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
    argv = [tool("mpirun"), "-np", "4", "--oversubscribe", "-x", "MASTER_ADDR=127.0.0.1",
            "-x", f"MASTER_PORT={free_port()}", "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONPATH",
            "-x", "DS_ACCELERATOR"]  # fmt: skip
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    argv += [sys.executable, "-m", "dsnd", "train"]
    train_three_steps_like(argv, log_dir, nprocs2_zero3)


@pytest.mark.launch
def test_deepspeed_launcher_four_ranks_runs_launch_script(tmp_path, nprocs2_zero3):
    log_dir = tmp_path / "log"
    argv = [tool("deepspeed"), "--num_gpus", "4", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "launch/train.py"]  # fmt: skip
    train_three_steps_like(argv, log_dir, nprocs2_zero3)
    assert (log_dir / "config.yaml").is_file() and (log_dir / "deepspeed.json").is_file()
    saved = json.loads((log_dir / "deepspeed.resolved.json").read_text())
    assert saved["gradient_accumulation_steps"] == 2  # 16 = 2 micro x 2 accumulation x 4 ranks
