"""dsnd's agents and supervisor with real processes on this machine (two local "hosts", each an
agent process), ranks being stand-ins that beat like `dsnd train` (agent_rank.py): a failing,
killed, stopped or orphan-making rank ends the whole job quickly and is named; SIGTERM reaches
every rank; the launcher going away takes every rank with it; variables arrive byte for byte."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsnd.launcher.command_lines import python_module_argv
from dsnd.launcher.environment import passed_env
from dsnd.launcher.hostfile import read_deepspeed_env
from dsnd.launcher.protocol import AgentSpec
from dsnd.launcher.supervisor import AgentLaunch, supervise
from tests.procs import ROOT

RANK_PROGRAM = os.path.join(ROOT, "tests", "integration", "agent_rank.py")
AGENT = [sys.executable, "-m", "dsnd.launcher.agent"]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the agents import this checkout


def launches(out_dir, hosts, actions=(), hang_s=60.0, env=None, devices=None):
    world = sum(len(r) for r in hosts)
    program = [sys.executable, RANK_PROGRAM, str(out_dir), *actions]
    env = {"PYTHONPATH": ROOT, **(env or {})}
    return [
        AgentLaunch(
            f"host{i}",
            AGENT,
            AgentSpec(
                f"host{i}",
                ranks,
                world,
                "127.0.0.1",
                1,
                program,
                ROOT,
                env,
                hang_s,
                (devices or {}).get(i, []),
            ),
        )
        for i, ranks in enumerate(hosts)
    ]


def record(out_dir, rank, timeout=30.0) -> dict:
    path = os.path.join(out_dir, f"rank_{rank}.json")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) or os.path.getsize(path) == 0:
        assert time.monotonic() < deadline, f"rank {rank} never started"
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def after_start(out_dir, ranks, act):
    """In a thread: once every rank in `ranks` has started, call act(records)."""

    def run():
        act({r: record(out_dir, r) for r in ranks})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_failing_rank_ends_every_rank_on_every_host(tmp_path):
    t0 = time.monotonic()
    result = supervise(launches(tmp_path, [[0, 1], [2]], ["1=exit5"]), out=io.BytesIO())
    assert result.failure == "rank 1 on host host0 exited with code 5"
    codes = {o.rank: (o.code, o.ended_by_agent) for o in result.outcomes}
    assert codes == {0: (-9, True), 1: (5, False), 2: (-9, True)}
    assert time.monotonic() - t0 < 20
    assert not any(alive(record(tmp_path, r)["pid"]) for r in range(3))


def test_sigkill_of_a_rank_is_named_and_grandchildren_go_too(tmp_path):
    ranks = [0, 1, 2]
    seen = {}

    def kill(records):
        seen.update(records)
        time.sleep(1.5)
        os.kill(records[2]["pid"], signal.SIGKILL)

    after_start(tmp_path, ranks, kill)
    result = supervise(launches(tmp_path, [[0], [1, 2]], ["0=child"]), out=io.BytesIO())
    assert result.failure == "rank 2 on host host1 was killed by SIGKILL"
    assert not alive(seen[0]["child"])  # the rank's own child: no orphan
    assert not any(alive(seen[r]["pid"]) for r in ranks)


def test_a_sigabrt_is_named_an_nccl_watchdog_abort_and_ranks_see_their_hosts_slots(tmp_path):
    """A rank the NCCL watchdog would end (os.abort(): SIGABRT, no Python handler runs) fails
    the job under that name; every rank saw its own host's selected slots as its GPUs, over the
    value the spec's variables carry."""
    env = {"DUMP_ENV": "CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES": "7"}
    result = supervise(
        launches(tmp_path, [[0, 1], [2]], ["2=abort"], env=env, devices={0: [1, 3], 1: [2]}),
        out=io.BytesIO(),
    )
    assert result.failure.startswith(
        "rank 2 on host host1 was killed by SIGABRT: NCCL watchdog abort (collective timeout?)"
    )
    assert [record(tmp_path, r)["env"]["CUDA_VISIBLE_DEVICES"] for r in range(3)] == [
        "1,3",
        "1,3",
        "2",
    ]


def test_a_stopped_rank_ends_the_job_after_the_timeout(tmp_path):
    stopped_at = []

    def stop(records):
        time.sleep(1.5)
        os.kill(records[1]["pid"], signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    after_start(tmp_path, [0, 1], stop)
    result = supervise(launches(tmp_path, [[0], [1]], hang_s=3.0), out=io.BytesIO())
    took = time.monotonic() - stopped_at[0]
    assert re.fullmatch(
        r"rank 1 on host host1 was stopped \(SIGSTOP or a debugger\) for \d s "
        r"\(dist\.timeout_s=3\)",
        result.failure,
    )
    assert 3.0 <= took < 3.0 + 5, took
    assert not any(alive(record(tmp_path, r)["pid"]) for r in (0, 1))


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path):
    after_start(tmp_path, [0, 1, 2], lambda _: os.kill(os.getpid(), signal.SIGTERM))
    result = supervise(launches(tmp_path, [[0, 1], [2]]), out=io.BytesIO())
    assert (result.failure, result.stop_signal) == (None, "SIGTERM")
    assert all(os.path.exists(tmp_path / f"rank_{r}.term") for r in range(3))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_ctrl_c_asks_once_then_kills(tmp_path):
    def twice(_):
        os.kill(os.getpid(), signal.SIGINT)  # first: SIGTERM to every rank (save and exit)
        deadline = time.monotonic() + 20
        while not all(os.path.exists(tmp_path / f"rank_{r}.term") for r in (0, 1)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # second: now

    after_start(tmp_path, [0, 1], twice)
    t0 = time.monotonic()
    result = supervise(
        launches(tmp_path, [[0], [1]], ["0=stubborn", "1=stubborn"]), out=io.BytesIO()
    )
    assert result.stop_signal == "SIGINT"
    assert {(o.code, o.ended_by_agent) for o in result.outcomes} == {(-9, True)}
    assert time.monotonic() - t0 < 20
    assert not any(alive(record(tmp_path, r)["pid"]) for r in (0, 1))


def test_the_launcher_going_away_ends_the_ranks(tmp_path):
    (launch,) = launches(tmp_path, [[0, 1]])
    agent = subprocess.Popen(AGENT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    agent.stdin.write(launch.spec.to_line())
    agent.stdin.flush()
    pids = [record(tmp_path, r)["pid"] for r in (0, 1)]
    agent.stdin.close()  # what a closed ssh connection looks like to the agent
    assert agent.wait(timeout=20) == 1
    assert not any(alive(p) for p in pids)


def test_variables_arrive_byte_for_byte(tmp_path):
    value = 'it\'s "$HOME" `x` \\n\n{"json": [1, 2]}\t$(echo no) ünï'
    env = {"DUMP_ENV": "TRICKY,HF_TOKEN", "TRICKY": value, "HF_TOKEN": "hf_secret"}
    after_start(tmp_path, [0, 1], lambda _: os.kill(os.getpid(), signal.SIGTERM))
    out = io.BytesIO()
    result = supervise(launches(tmp_path, [[0], [1]], env=env), out=out)
    assert result.failure is None
    for r in (0, 1):
        assert record(tmp_path, r)["env"] == {"TRICKY": value, "HF_TOKEN": "hf_secret"}


def test_variables_reach_remote_hosts_byte_for_byte(cluster, tmp_path, monkeypatch):
    """Over ssh to both loopback hosts, with the environment `dsnd launch` builds: a launch.env
    variable with shell-hostile bytes and a .deepspeed_env line."""
    value = 'a\'b "$HOME" `id` $(id) ;|& \\ \n\n{"k": ["v"]}\t✓'
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text('FROM_FILE={"json": "$x y"}\n')
    monkeypatch.setenv("TRICKY", value)
    env = passed_env(dict(os.environ), ["TRICKY"], read_deepspeed_env([str(env_file)]))
    env["DUMP_ENV"] = "TRICKY,FROM_FILE"
    specs = launches(tmp_path, [[0], [1]], env=env)
    for launch, host in zip(specs, cluster.hosts, strict=True):
        launch.host = launch.spec.host = host
        launch.argv = [
            *cluster.prefix,
            *python_module_argv(host, sys.executable, "dsnd.launcher.agent", ROOT, ROOT),
        ]
    monkeypatch.setenv("PATH", cluster.env["PATH"])
    after_start(tmp_path, [0, 1], lambda _: os.kill(os.getpid(), signal.SIGTERM))
    result = supervise(specs, out=io.BytesIO())
    assert result.failure is None
    for r in (0, 1):
        assert record(tmp_path, r)["env"] == {"TRICKY": value, "FROM_FILE": '{"json": "$x y"}'}
