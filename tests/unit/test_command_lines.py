"""Launcher argv builders, checked as argv and against DeepSpeed's own argument parser."""

from __future__ import annotations

import importlib

import pytest

from dsnd.errors import UserError
from dsnd.launcher.command_lines import (
    deepspeed_hostfile_argv,
    deepspeed_local_argv,
    mpirun_argv,
    placement,
)

TRAIN = ["--config", "run.yaml", "--name", "a b"]
SLOTS = {"h1": [0, 1], "h2": [0, 1]}


def test_deepspeed_local_argv():
    assert deepspeed_local_argv(4, "127.0.0.1", 29500, TRAIN) == [
        "deepspeed",
        "--num_gpus",
        "4",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29500",
        "--module",
        "dsnd",
        "train",
        "--config",
        "run.yaml",
        "--name",
        "a b",
    ]


def test_deepspeed_hostfile_argv():
    argv = deepspeed_hostfile_argv("hf", "pdsh", "10.0.0.1", 29600, "h1@h2:0", None, TRAIN)
    assert argv == [
        "deepspeed",
        "--hostfile",
        "hf",
        "--launcher",
        "pdsh",
        "--include",
        "h1@h2:0",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "29600",
        "--module",
        "dsnd",
        "train",
        *TRAIN,
    ]
    argv = deepspeed_hostfile_argv("hf", "pdsh", "a", 1, None, "h2:1", [], force_multi=True)
    assert argv == [
        "deepspeed",
        "--hostfile",
        "hf",
        "--launcher",
        "pdsh",
        "--exclude",
        "h2:1",
        "--force_multi",
        "--master_addr",
        "a",
        "--master_port",
        "1",
        "--module",
        "dsnd",
        "train",
    ]
    assert "--include" not in deepspeed_hostfile_argv("hf", "pdsh", "a", 1, "", "", [])


def test_argv_parses_as_deepspeed_runner_expects():
    """DeepSpeed's own parser reads our flags as meant (a misspelt flag would land in user_args)."""
    runner = importlib.import_module("deepspeed.launcher.runner")
    local = runner.parse_args(deepspeed_local_argv(3, "127.0.0.1", 29501, TRAIN)[1:])
    assert (local.num_gpus, local.master_addr, local.master_port) == (3, "127.0.0.1", 29501)
    assert (local.module, local.user_script, local.user_args) == (True, "dsnd", ["train", *TRAIN])

    argv = deepspeed_hostfile_argv("hf", "pdsh", "10.0.0.1", 29600, "h1", None, TRAIN, True)
    multi = runner.parse_args(argv[1:])
    assert (multi.hostfile, multi.launcher) == ("hf", "pdsh")
    assert (multi.include, multi.exclude) == ("h1", "")
    assert (multi.force_multi, multi.master_addr, multi.master_port) == (True, "10.0.0.1", 29600)
    assert (multi.module, multi.user_script, multi.user_args) == (True, "dsnd", ["train", *TRAIN])
    argv = deepspeed_hostfile_argv("hf", "pdsh", "a", 1, None, "h2:0", [])
    assert runner.parse_args(argv[1:]).exclude == "h2:0"


def test_mpirun_openmpi():
    env = {"NCCL_DEBUG": "INFO", "OPTS": "a=b c"}
    argv = mpirun_argv("openmpi", SLOTS, "h1", 29500, env, "/venv/bin/python", TRAIN, False)
    assert argv == [
        "mpirun",
        "-np",
        "4",
        "--host",
        "h1:2,h2:2",
        "--map-by",
        "slot",
        "--oversubscribe",
        "-x",
        "MASTER_ADDR=h1",
        "-x",
        "MASTER_PORT=29500",
        "-x",
        "CUDA_VISIBLE_DEVICES=0,1",
        "-x",
        "NCCL_DEBUG=INFO",
        "-x",
        "OPTS=a=b c",
        "/venv/bin/python",
        "-m",
        "dsnd",
        "train",
        *TRAIN,
    ]
    root = mpirun_argv("openmpi", {"h": [0]}, "h", 1, {}, "py", [], True)
    assert root == [
        "mpirun",
        "-np",
        "1",
        "--host",
        "h:1",
        "--map-by",
        "slot",
        "--oversubscribe",
        "--allow-run-as-root",
        "-x",
        "MASTER_ADDR=h",
        "-x",
        "MASTER_PORT=1",
        "-x",
        "CUDA_VISIBLE_DEVICES=0",
        "py",
        "-m",
        "dsnd",
        "train",
    ]


def test_mpirun_mpich():
    slots = {"h1": [0, 1, 2], "h2": [0]}
    argv = mpirun_argv("mpich", slots, "h1", 29500, {"K": "v w"}, "python", ["--x"], True)
    assert argv == [
        "mpirun",
        "-n",
        "4",
        "-hosts",
        "h1:3,h2:1",
        "-genv",
        "MASTER_ADDR",
        "h1",
        "-genv",
        "MASTER_PORT",
        "29500",
        "-genv",
        "CUDA_VISIBLE_DEVICES",
        "0,1,2",
        "-genv",
        "K",
        "v w",
        "python",
        "-m",
        "dsnd",
        "train",
        "--x",
    ]


def test_mpirun_explicit_master_and_slots_win_over_env():
    env = {"MASTER_PORT": "1", "MASTER_ADDR": "x", "A": "1", "CUDA_VISIBLE_DEVICES": "5"}
    argv = mpirun_argv("openmpi", SLOTS, "h1", 29500, env, "py", [], False)
    assert [a for a in argv if "=" in a] == [
        "MASTER_ADDR=h1",
        "MASTER_PORT=29500",
        "CUDA_VISIBLE_DEVICES=0,1",
        "A=1",
    ]


def test_mpirun_rejects_unknown_flavor_and_pinned_slots():
    with pytest.raises(ValueError, match="unknown MPI flavor 'slurm'"):
        mpirun_argv("slurm", SLOTS, "h1", 1, {}, "py", [], False)
    with pytest.raises(UserError, match=r"cannot use slots \[0, 2\] on host 'h2'"):
        mpirun_argv("openmpi", {"h1": [0, 1], "h2": [0, 2]}, "h1", 1, {}, "py", [], False)
    with pytest.raises(ValueError, match="no hosts"):
        mpirun_argv("mpich", {}, "h1", 1, {}, "py", [], False)


def test_placement_fills_hosts_in_order():
    assert placement({"h1": [0, 1], "h2": [1, 3]}) == [("h1", 0), ("h1", 1), ("h2", 0), ("h2", 1)]
    assert placement({"b": [0, 1, 2], "a": [2]}) == [("b", 0), ("b", 1), ("b", 2), ("a", 0)]
    assert placement({}) == []


def test_mpirun_host_list_agrees_with_placement():
    """The `host:count` list mpirun maps slot by slot reproduces placement() rank by rank."""
    slots = {"n2": [0, 1, 2], "n0": [0], "n1": [0, 1]}
    argv = mpirun_argv("openmpi", slots, "n2", 1, {}, "py", [], False)
    hosts = argv[argv.index("--host") + 1]
    by_slot = []
    for item in hosts.split(","):
        host, count = item.split(":")
        by_slot += [(host, i) for i in range(int(count))]
    assert by_slot == placement(slots)
    assert argv[argv.index("-np") + 1] == str(len(placement(slots)))
