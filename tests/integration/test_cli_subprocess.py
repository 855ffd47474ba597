"""`python -m dsnd` as a real process: what a user's shell sees (stdout, stderr, exit code).

Each call pays DeepSpeed's and torch's imports (~4 s), so there are five of them; the in-process
tests in tests/unit/test_cli.py cover the many cases.
"""

from __future__ import annotations

import importlib.metadata as md

import torch

import dsnd
from tests.procs import ROOT, run_cli

HEADER = ["rank", "host", "local_rank", "pp", "dp", "cp", "tp"]


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dsnd: error: ")
    return lines[0]


def test_version():
    proc = run_cli(["--version"], timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == f"dsnd {dsnd.__version__}\n"


def test_env():
    proc = run_cli(["env"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) for line in proc.stdout.splitlines())
    assert rows["dsnd"] == dsnd.__version__
    assert rows["deepspeed"] == md.version("deepspeed")
    assert rows["torch"] == torch.__version__
    assert rows["transformers"] == md.version("transformers")
    assert "mpi" in rows and rows["mpi"]
    assert rows["accelerator"] == "cpu"  # run_cli pins DS_ACCELERATOR=cpu
    assert rows["backend"] == "gloo"


def test_acceptance_dry_run_prints_four_ranks():
    proc = run_cli(
        [
            "launch",
            "--nprocs",
            "4",
            "--dry-run",
            "--set",
            "parallel.pp=2",
            "--set",
            "parallel.tp=2",
        ],
        timeout=60,
    )
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    command, agent, *rest = proc.stdout.splitlines()
    end = next(i for i, line in enumerate(rest) if line.startswith("plan: "))
    table, plan = rest[:end], rest[end:]
    assert plan[0].startswith("plan: pp=2 dp=1 tp=2, ZeRO-0, schedule 1f1b")
    argv = command.split()  # then the default log.dir made absolute, and the job id
    assert argv[1:-4] == [
        "-u",
        "-m",
        "dsnd",
        "train",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.tp=2",
    ]
    assert argv[-4:-2] == ["--set", f"log.dir={ROOT}/runs/dsnd"] and argv[-2] == "--job-id"
    assert agent.startswith("agent on localhost: ") and agent.endswith("-m dsnd.launcher.agent")
    assert len(table) == 5  # exactly the header and 4 rows
    assert table[0].split() == HEADER
    rows = [line.split() for line in table[1:]]
    assert rows == [
        ["0", "localhost", "0", "0", "0", "0", "0"],
        ["1", "localhost", "1", "0", "0", "0", "1"],
        ["2", "localhost", "2", "1", "0", "0", "0"],
        ["3", "localhost", "3", "1", "0", "0", "1"],
    ]


def test_bad_hostfile_is_one_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=4\nnode-2 slots=4x\n")
    proc = run_cli(["launch", "--hostfile", str(hostfile), "--dry-run"], timeout=60)
    assert _one_error_line(proc) == (
        f"dsnd: error: {hostfile}:2: slots must be a positive integer, got '4x'"
    )


def test_bad_deepspeed_key_is_one_line(tmp_path):
    (tmp_path / "ds.json").write_text(
        '{"train_batch_szie": 16, "train_micro_batch_size_per_gpu": 2}'
    )
    (tmp_path / "run.yaml").write_text("deepspeed: ds.json\n")
    # not a dry run: the check must still happen in this process, before any rank starts
    proc = run_cli(["launch", "--nprocs", "2", "--config", str(tmp_path / "run.yaml")], timeout=60)
    assert _one_error_line(proc) == (
        f"dsnd: error: {tmp_path / 'ds.json'}: unknown key 'train_batch_szie' "
        "(did you mean 'train_batch_size'?)"
    )
