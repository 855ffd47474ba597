"""Pure parts of dsnd's own launcher: failure diagnosis, secrets, passed environment, preflight
verdicts, remote command lines, restarts; preflight's port probe against real sockets; the
loopback test cluster's clean-up."""

from __future__ import annotations

import importlib.util
import os
import shlex
import socket

import pytest

from dsnd.errors import UserError
from dsnd.launcher.command_lines import python_module_argv
from dsnd.launcher.environment import describe, passed_env
from dsnd.launcher.preflight import port_free, problems
from dsnd.launcher.protocol import AgentSpec, RankOutcome, diagnose, event_line, parse_event
from dsnd.secrets import MASK, is_secret, mask_config, mask_env
from tests.cluster import CREATED_FILES, Cluster, _setup_files
from tests.procs import ROOT


def outcome(rank, code, stopped=0.0, by_agent=False, at=0.0, reason="", host="h"):
    return RankOutcome(rank, host, code, stopped, by_agent, at, reason)


def test_diagnose_all_ok_is_none():
    assert diagnose([outcome(0, 0), outcome(1, 0)]) is None


def test_diagnose_names_the_killed_rank_before_peers_that_errored_earlier_or_later():
    # rank 1 SIGKILLed; rank 0's collective failed right after (exit 1); rank 2 ended by its agent
    got = diagnose(
        [
            outcome(0, 1, at=10.02),
            outcome(1, -9, at=10.00, host="b"),
            outcome(2, -9, by_agent=True, at=10.5),
        ]
    )
    assert got == "rank 1 on host b was killed by SIGKILL"
    # a signal death wins even when the exit-1 peer was recorded first
    got = diagnose([outcome(0, 1, at=9.0), outcome(3, -11, at=9.5)])
    assert got == "rank 3 on host h was killed by SIGSEGV"


def test_diagnose_earliest_error_exit():
    got = diagnose([outcome(0, 1, at=5.0), outcome(1, 2, at=4.0), outcome(2, 0)])
    assert got == "rank 1 on host h exited with code 2 (bad input)"


def test_diagnose_a_stopped_rank_before_the_peer_whose_collective_timed_out():
    got = diagnose(
        [
            outcome(0, 1, at=30.0),
            outcome(1, -9, 29.6, by_agent=True, host="b"),
            outcome(2, -9, by_agent=True),
        ]
    )
    assert got == "rank 1 on host b was stopped (frozen for 30 s)"
    found = outcome(1, -9, 31.0, by_agent=True, reason="was stopped (...) for 31 s")
    assert diagnose([outcome(0, -9, by_agent=True), found]) == (
        "rank 1 on host h was stopped (...) for 31 s"
    )
    # stopped only briefly when the job ended (a debugger's pause): not the cause
    assert diagnose([outcome(0, 1, at=1.0), outcome(1, -9, 0.4, by_agent=True)]) == (
        "rank 0 on host h exited with code 1"
    )


def test_spec_and_events_round_trip():
    spec = AgentSpec(
        "h",
        [2, 3],
        4,
        "127.0.0.1",
        29500,
        ["python", "-c", "x"],
        "/w",
        {"A": 'it\'s "$HOME"\n{"json": [1]}'},
        12.5,
    )
    assert AgentSpec.from_line(spec.to_line()) == spec
    env = spec.rank_env(1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "1",
        "4",
        "2",
    )
    assert env["A"] == spec.env["A"]
    assert parse_event(event_line("failed", rank=3)) == {"event": "failed", "rank": 3}
    assert parse_event(b"[r0] step 1 loss 5.6\n") is None


def test_secrets_are_matched_by_name_and_masked():
    for name in ("HF_TOKEN", "WANDB_API_KEY", "aws_secret_access_key", "DB_PASSWORD", "api_key"):
        assert is_secret(name), name
    for name in ("OMP_NUM_THREADS", "PATH", "num_kv_heads"):
        assert not is_secret(name), name
    assert is_secret("tokenizer_dir")  # substring match: over-masking is the accepted cost
    assert mask_env({"HF_TOKEN": "hf_abc", "X": "1"}) == {"HF_TOKEN": MASK, "X": "1"}
    cfg = {"comet": {"api_key": "abc", "enabled": True}, "steps": [1, {"password": 5}]}
    assert mask_config(cfg) == {
        "comet": {"api_key": MASK, "enabled": True},
        "steps": [1, {"password": MASK}],
    }
    assert cfg["comet"]["api_key"] == "abc"  # a copy


def test_passed_env_prefixes_names_and_env_file():
    environ = {
        "PYTHONPATH": "/p",
        "NCCL_DEBUG": "INFO",
        "HOME": "/root",
        "HF_TOKEN": "hf_x",
        "RANK": "7",
        "DSND_FAULT": "1",
    }
    got = passed_env(environ, ["HF_TOKEN"], {"OMP_NUM_THREADS": "1", "MASTER_PORT": "1"})
    assert got == {
        "DSND_FAULT": "1",
        "HF_TOKEN": "hf_x",
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/p",
    }
    line = describe(got)
    assert "hf_x" not in line and f"HF_TOKEN={MASK}" in line and 'PYTHONPATH="/p"' in line
    with pytest.raises(UserError, match="launch.env: MISSING not set"):
        passed_env(environ, ["MISSING"], {})


def test_remote_module_command_is_quoted_and_local_is_plain():
    assert python_module_argv(None, "/v/py", "m", "/w", None) == ["/v/py", "-u", "-m", "m"]
    argv = python_module_argv("h2", "/v/py", "m", "/my dir/$x", "/a b:/c")
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "h2"]
    assert shlex.split(argv[4]) == [
        "cd",
        "/my dir/$x",
        "&&",
        "exec",
        "env",
        "PYTHONPATH=/a b:/c",
        "/v/py",
        "-u",
        "-m",
        "m",
    ]


def test_preflight_problems_one_line_each():
    want = {"dsnd": "0.1.0", "deepspeed": "0.19.8", "torch": "2.13.0"}
    request = {"addr": "127.0.0.1", "port": 29500, "dir": "/ck"}
    ok = {"versions": want, "port_free": True, "dir_problem": None}
    assert problems({"a": ok, "b": {**ok, "port_free": None}}, want, request) == []
    bad = {
        "a": {**ok, "port_free": False},
        "b": {"versions": {**want, "torch": "2.12.0"}, "dir_problem": "is not writable (x)"},
        "c": "ssh exited with code 255: Connection refused",
    }
    assert problems(bad, want, request) == [
        "host a: rendezvous port 127.0.0.1:29500 is in use (pick another with --master-port)",
        "host b: torch 2.12.0, but the launcher has 2.13.0",
        "host b: checkpoint directory /ck is not writable (x)",
        "host c: unreachable: ssh exited with code 255: Connection refused",
    ]


def test_port_probe_sees_a_listener_on_another_local_address():
    # rank 0's store listens on every address, so 127.0.0.2:P blocks it as much as 127.0.0.1:P
    with socket.socket() as other:
        other.bind(("127.0.0.2", 0))
        other.listen()
        assert port_free("127.0.0.1", other.getsockname()[1]) is False


def test_port_probe_agrees_with_a_real_store():
    import torch.distributed as dist

    for _ in range(5):  # another process may take the port between probe and store
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port_free("127.0.0.1", port):
            break
    else:
        raise AssertionError("no port the probe calls free")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("k", "v")
    assert port_free("127.0.0.1", port) is False  # and the probe sees the store itself
    del store


def _cluster_files(workdir: str) -> None:
    """What `launch/loopback_cluster.py start` leaves in its directory, sshd aside."""
    os.makedirs(workdir)
    _setup_files(workdir, ["127.0.0.1", "127.0.0.2"], 2222)  # real keys (ssh-keygen)
    for name in ("sshd.log", "sshd.out", "hostfile", "sshd.pid"):
        with open(os.path.join(workdir, name), "w") as f:
            f.write("4194304\n" if name == "sshd.pid" else "")  # above pid_max: not running


def test_loopback_cluster_stop_removes_what_start_wrote(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "loopback_cluster", os.path.join(ROOT, "launch", "loopback_cluster.py")
    )
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    workdir = str(tmp_path / "cluster")
    _cluster_files(workdir)
    written = {
        os.path.relpath(os.path.join(d, f), workdir)
        for d, _, files in os.walk(workdir)
        for f in files
    }
    assert "id_ed25519" in written and written <= set(CREATED_FILES)
    assert script.stop(workdir) == 0
    assert not os.path.exists(workdir)  # the private key with it


def test_test_cluster_stop_removes_its_files_and_keeps_others(tmp_path):
    workdir = str(tmp_path / "cluster")
    _cluster_files(workdir)
    (tmp_path / "cluster" / "notes.txt").write_text("not the cluster's")
    Cluster(["127.0.0.1"], {}, workdir).stop()
    assert os.listdir(workdir) == ["notes.txt"]


def test_a_vanished_host_is_named_when_the_ranks_left_only_followed_it():
    """Ranks killed by their agents as the job ended, or failing because a peer went, are not
    the cause of a failure a vanished host's agent explains (dsnd.launcher.supervisor)."""
    from dsnd.launcher.protocol import RankOutcome, cause_among

    ended = [RankOutcome(r, "h1", -9, 0.0, True) for r in range(2)]
    assert not cause_among(ended)
    assert not cause_among([*ended, RankOutcome(2, "h2", 4, 0.0, False)])  # a peer failed first
    assert not cause_among([*ended, RankOutcome(2, "h2", -6, 0.0, False)])  # NCCL watchdog
    assert cause_among([*ended, RankOutcome(2, "h2", -9, 0.0, False)])  # killed from outside
    assert cause_among([*ended, RankOutcome(2, "h2", 1, 0.0, False)])  # its own error
    assert cause_among([RankOutcome(0, "h1", -9, 30.0, True)])  # frozen, then killed


def test_elastic_flags_are_checked_before_anything_starts():
    import argparse

    from dsnd.commands.launch import _check_elastic

    def args(**kw):
        base = dict(min_hosts=None, rejoin=False, launcher="dsnd", hostfile="hosts")
        return argparse.Namespace(**{**base, **kw})

    slots = {"a": [0], "b": [0], "c": [0]}
    assert _check_elastic(args(), slots) is False
    assert _check_elastic(args(min_hosts=2), slots) is True
    for bad, said in (
        (args(rejoin=True), "--rejoin needs --min-hosts"),
        (args(min_hosts=4), "--min-hosts must be in 1..3"),
        (args(min_hosts=0), "--min-hosts must be in 1..3"),
        (args(min_hosts=2, launcher="pdsh"), "--min-hosts needs --hostfile and the dsnd launcher"),
        (args(min_hosts=1, hostfile=None), "--min-hosts needs --hostfile"),
    ):
        with pytest.raises(UserError, match=said):
            _check_elastic(bad, slots)


def test_a_failed_attempt_blames_a_vanished_host_or_one_failing_at_start():
    from dsnd.commands.launch_elastic import suspects
    from dsnd.launcher.protocol import RankOutcome
    from dsnd.launcher.supervisor import JobResult

    ended = [RankOutcome(0, "a", -9, 0.0, True, 5.0), RankOutcome(1, "b", 4, 0.0, False, 4.0)]
    gone = JobResult(ended, "the agent on host c ...", None, lost_hosts=["c"])
    assert list(suspects(gone, progressed=True)) == ["c"]
    own = RankOutcome(2, "c", 1, 0.0, False, 6.0)  # its own error, after the peer's code 4
    failed = JobResult([*ended, own], "rank 2 on host c exited with code 1", None)
    assert suspects(failed, progressed=True) == {}  # it trained: a restart may mend it
    assert list(suspects(failed, progressed=False)) == ["c"]  # not past the start: left out
