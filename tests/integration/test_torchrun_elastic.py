"""torchrun's elastic membership, `--nnodes 1:2`, with `elastic.enabled`: two agents on the
loopback cluster (127.0.0.1 here, 127.0.0.2 over ssh), one worker each, pp=2 x dp=1, llama-tiny,
global batch 12 (micro-batch 2), 16 steps, a checkpoint every 2.

After step 5 (step 4 committed) the second node is lost: its agent and worker are SIGKILLed.
torchrun's agent on the first node restarts its worker (a counted restart) in a rendezvous of one
node: the world is 1 rank, where pp=2 cannot run, so the elastic rule changes pp to 1 (6
accumulation steps), and the job's step-4 checkpoint resumes on it. Once that worker has logged a
step the node comes back (a new agent joins the rendezvous): torchrun restarts the worker (a
membership change, not counted), which saves at the next step (torchrun's SIGTERM) and the world of
2 resumes on pp=2 to the end. Both agents exit 0.

Every step (its last run) equals the single-process plain-PyTorch reference within rel 1e-4 (loss
and gradient norm), on whatever world ran it; metrics.jsonl's run_start rows show the three
layouts. No process of the job is left.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
import uuid

import pytest

from tests.cluster import processes_with_env
from tests.integration.conftest import ELASTIC_SETS
from tests.integration.test_elastic import _close, _last_of_each_step
from tests.integration.test_torchrun import REMOTE_ENV, TAG, logged, start, torchrun_argv
from tests.procs import ROOT, free_port, metrics_rows, rank_env

SHARE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch 2.13's c10d rendezvous shares the first round's store server and never publishes its
address again, so a node joining a later round waits for it forever (`MASTER_ADDR` of round N):
every agent of an elastic job needs this set (docs/launching.md, "Elastic jobs")."""
STEPS = 16  # ELASTIC_SETS' train.steps
LOST_AFTER = 5
TIMEOUT = 400
SETS = (*ELASTIC_SETS, "checkpoint.resume=never", "dist.timeout_s=20")


def _argv(addr: str, endpoint: str, run_id: str, log_dir: str) -> list[str]:
    # (torch's keep-alive defaults, 3 missed heartbeats of 5 s: with shorter ones a busy
    # agent was taken for dead, and the joining node formed a job of its own)
    return torchrun_argv(
        addr,
        endpoint,
        run_id,
        log_dir,
        nnodes="1:2",
        nproc=1,
        conf=",last_call_timeout=3",
        sets=("elastic.enabled=true", *SETS),
    )


def _remote(cluster, env, endpoint, run_id, log_dir, log_path):
    remote_env = [f"{k}={env[k]}" for k in (*REMOTE_ENV, SHARE_OFF) if k in env]
    remote = shlex.join(["env", *remote_env, *_argv("127.0.0.2", endpoint, run_id, log_dir)])
    return start(
        [*cluster.prefix, "ssh", "127.0.0.2", f"cd {shlex.quote(ROOT)} && exec {remote}"],
        env,
        log_path,
    )


def _on_node_two(tag: str) -> list[int]:
    """The job's processes started in an ssh session to 127.0.0.2 (its agent and worker)."""
    from tests.cluster import environ_of

    return [
        pid
        for pid in processes_with_env(TAG, tag)
        if environ_of(pid).get("SSH_CONNECTION", "").split()[2:3] == ["127.0.0.2"]
    ]


def _wait(ready, agents, what: str, deadline: float, output) -> None:
    while not ready():
        assert all(a.poll() is None for a in agents), f"an agent ended before {what}" + output()
        assert time.monotonic() < deadline, f"no {what}" + output()
        time.sleep(0.1)


@pytest.mark.launch
def test_torchrun_elastic_node_lost_and_back_keeps_the_losses(cluster, tmp_path, elastic_reference):
    tag, run_id = uuid.uuid4().hex, f"dsnd-elastic-{uuid.uuid4().hex[:8]}"
    log_dir = str(tmp_path / "log")
    endpoint = f"127.0.0.1:{free_port()}"
    env = rank_env({**cluster.env, TAG: tag, SHARE_OFF: "1"})
    logs = [tmp_path / "node1.log", tmp_path / "node2.log", tmp_path / "node2_again.log"]

    def output() -> str:
        return "".join(f"\n--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())

    first = start([*cluster.prefix, *_argv("127.0.0.1", endpoint, run_id, log_dir)], env, logs[0])
    agents = [first, _remote(cluster, env, endpoint, run_id, log_dir, logs[1])]
    deadline = time.monotonic() + TIMEOUT
    try:
        _wait(lambda: logged(log_dir) >= LOST_AFTER, agents, f"step {LOST_AFTER}", deadline, output)
        for pid in _on_node_two(tag):  # the node is lost: its agent and worker, at once
            os.kill(pid, signal.SIGKILL)
        agents[1].wait(timeout=30)
        lost = logged(log_dir)
        _wait(lambda: logged(log_dir) > lost, [first], "a step on one node", deadline, output)
        agents.append(_remote(cluster, env, endpoint, run_id, log_dir, logs[2]))
        codes = [a.wait(timeout=max(1, deadline - time.monotonic())) for a in (first, agents[2])]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for pid in processes_with_env(TAG, tag):
            os.kill(pid, signal.SIGKILL)
    assert codes == [0, 0], output()
    rows = metrics_rows(log_dir)
    starts = [r["run_start"] for r in rows if "run_start" in r]
    layouts = [(s["layout"]["world"], s["layout"]["pp"], s["layout"]["dp"]) for s in starts]
    assert layouts == [(2, 2, 1), (1, 1, 1), (2, 2, 1)], (layouts, output())
    assert starts[1]["resumed_from"].endswith("step_00000004"), starts
    assert "changed of the run config: pp 2->1" in logs[0].read_text(), output()
    final = _last_of_each_step(rows)
    assert [r["step"] for r in final] == list(range(1, STEPS + 1))
    for got, want in zip(final, elastic_reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert _close(got[key], want[key]), (got["step"], key, got[key], want[key])
    with open(os.path.join(log_dir, "checkpoints", "latest")) as f:
        assert f.read() == f"step_{STEPS:08d}\n"
