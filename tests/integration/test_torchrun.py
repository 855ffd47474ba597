"""`torchrun -m dsnd train` across the loopback cluster (tests/cluster.py): one job of two torchrun
agents joined by torchrun's own c10d rendezvous, one per "host", 2 workers each (pp=2 x dp=2,
ZeRO-3, llama-tiny, 8 steps, a checkpoint every 2).

The agent on 127.0.0.1 is started here (`--local-addr 127.0.0.1`, it hosts the rendezvous store);
the one on 127.0.0.2 inside an ssh session to that host (`--local-addr 127.0.0.2`), with the
environment passed on its command line as a user's remote shell would. Once the step-4
checkpoint is committed and step 5 logged, one worker of the second agent is SIGKILLed: torchrun
(--max-restarts 1) restarts every worker (which start from a store of their own attempt:
`dsnd.distributed.elastic_store`), and dsnd resumes the job's own step-4 checkpoint (the job id
is torchrun's rendezvous id, TORCHELASTIC_RUN_ID; checkpoint.resume=never, so no other
checkpoint would be taken). Both agents must exit 0; every step's loss equals the single-process
plain-PyTorch reference within rel 1e-4; step 5, run again after the restart, equals its first
run bit for bit; no process of the job is left.

And preemption: SIGTERM to a `torchrun --standalone` job reaches every worker; they stop after
one same step and commit it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import uuid

import pytest

from tests.cluster import Cluster, environ_of, processes_with_env
from tests.procs import ROOT, assert_same_steps, free_port, metrics_rows, python_json, rank_env

STEPS = 8
EVERY = 2
KILL_AT = 4  # the committed checkpoint that triggers the kill, and the restart's resume point
KILLED_RANK = 3  # a worker of the agent on 127.0.0.2
TIMEOUT = 300
TAG = "DSND_TEST_RUN"
SETS = (
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "checkpoint.resume=never",
    "log.tensorboard=false",
)
ZERO3 = os.path.join(ROOT, "ds_configs", "zero3.json")
# what the remote shell must be told: an ssh session only has the PATH sshd sets
REMOTE_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "DS_ACCELERATOR",
    "PYTHONUNBUFFERED",
    "PYTHONPATH",
    "TORCH_EXTENSIONS_DIR",
    TAG,
)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """The plain single-process PyTorch run's rows for the same run (parallel.pp=1, no JSON),
    after checking that zero3.json trains the same math as the default config: the same
    optimizer, scheduler, clipping and global batch."""
    code = (
        "import json; from dsnd.config.load import load; from dsnd.config.resolve import resolve;"
        "from tests.reference import reference_rows;"
        f"sets = {list(SETS)!r};"
        "res = resolve(load(None, [*sets, 'parallel.pp=1']), 1);"
        f"ds3 = resolve(load(None, [*sets, 'parallel.pp=2', 'deepspeed={ZERO3}']), 4).ds;"
        "keys = ('optimizer', 'scheduler', 'gradient_clipping', 'train_batch_size', "
        "'train_micro_batch_size_per_gpu', 'bf16', 'fp16');"
        "assert [res.ds.get(k) for k in keys] == [ds3.get(k) for k in keys], (res.ds, ds3);"
        "print(json.dumps(reference_rows(res)))"
    )
    return python_json(code, timeout=TIMEOUT)


def torchrun_argv(
    addr: str,
    endpoint: str,
    run_id: str,
    log_dir: str,
    nnodes: str = "2",
    nproc: int = 2,
    conf: str = "",
    sets: tuple[str, ...] = (f"deepspeed={ZERO3}", *SETS),
) -> list[str]:
    """One agent's command (`conf`: more --rdzv-conf, `sets`: the run's --set items after
    parallel.pp=2 and log.dir). `is_host` says which agent serves the rendezvous store: torch
    would guess that every agent does (the endpoint is a loopback address) and let the later
    ones fall back to clients."""
    return [
        "torchrun",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "1",
        "--local-addr",
        addr,
        "--rdzv-conf",
        f"is_host={int(addr == '127.0.0.1')}{conf}",
        "-m",
        "dsnd",
        "train",
        "--set",
        "parallel.pp=2",
        "--set",
        f"log.dir={log_dir}",
        *[a for s in sets for a in ("--set", s)],
    ]


def start(argv: list[str], env: dict[str, str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as out:  # a file: nobody reads the output while the job runs
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def workers(tag: str) -> dict[int, tuple[int, dict[str, str]]]:
    """rank -> (pid, environment) of every `dsnd train` worker carrying the tag."""
    found = {}
    for pid in processes_with_env(TAG, tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsnd\0train" not in f.read():
                    continue
        except OSError:
            continue
        env = environ_of(pid)
        if "RANK" in env:
            found[int(env["RANK"])] = (pid, env)
    return found


def host_of(cluster: Cluster, env: dict[str, str]) -> str | None:
    """The cluster host whose ssh session the process was started in (None: no session)."""
    conn = env.get("SSH_CONNECTION", "").split()  # client_ip client_port server_ip port
    return conn[2] if len(conn) == 4 and conn[3] == str(cluster.port) else None


def logged(log_dir: str) -> int:
    """How many metrics rows are complete so far (while rank 0 may be writing the next)."""
    try:
        with open(os.path.join(log_dir, "metrics.jsonl"), "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.launch
def test_torchrun_two_agents_restart_from_the_jobs_checkpoint(cluster, tmp_path, reference):
    tag, run_id = uuid.uuid4().hex, f"dsnd-test-{uuid.uuid4().hex[:8]}"
    log_dir = str(tmp_path / "log")
    latest = os.path.join(log_dir, "checkpoints", "latest")
    endpoint = f"127.0.0.1:{free_port()}"
    env = rank_env({**cluster.env, TAG: tag})
    remote_env = [f"{k}={env[k]}" for k in REMOTE_ENV if k in env]
    remote = shlex.join(
        ["env", *remote_env, *torchrun_argv("127.0.0.2", endpoint, run_id, log_dir)]
    )
    logs = [tmp_path / "agent_127.0.0.1.log", tmp_path / "agent_127.0.0.2.log"]
    t0 = time.monotonic()
    agents = [
        start(
            [*cluster.prefix, *torchrun_argv("127.0.0.1", endpoint, run_id, log_dir)], env, logs[0]
        ),
        start(
            [*cluster.prefix, "ssh", "127.0.0.2", f"cd {shlex.quote(ROOT)} && exec {remote}"],
            env,
            logs[1],
        ),
    ]

    def output() -> str:
        return "".join(f"\n--- {p.name}:\n{p.read_text()[-4000:]}" for p in logs)

    try:
        deadline = time.monotonic() + TIMEOUT
        # the kill comes once step KILL_AT is committed and step KILL_AT + 1 logged (so that the
        # restart runs a logged step again), well before step KILL_AT + 2's checkpoint
        while logged(log_dir) <= KILL_AT:
            assert all(a.poll() is None for a in agents), "an agent ended early" + output()
            assert time.monotonic() < deadline, f"no step {KILL_AT + 1}" + output()
            time.sleep(0.02)
        running = workers(tag)
        assert KILLED_RANK in running, f"workers running: {sorted(running)}"
        os.kill(running[KILLED_RANK][0], signal.SIGKILL)
        with open(latest) as f:
            at_kill = f.read()
        codes = [a.wait(timeout=max(1, deadline - time.monotonic())) for a in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for _ in range(75):
            if not (leftover := processes_with_env(TAG, tag)):
                break
            time.sleep(0.2)
        for pid in leftover:  # remote processes live in sshd's sessions, outside our groups
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.monotonic() - t0
    text, whole = output(), "".join(p.read_text() for p in logs)
    assert codes == [0, 0], text
    assert not leftover, f"processes outlived the job: {leftover}"
    assert at_kill == f"step_{KILL_AT:08d}\n", "the kill came too late to test the resume"

    # who ran where, and what torchrun told them
    assert sorted(running) == [0, 1, 2, 3]
    told = (
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
    )
    print({rank: {k: e.get(k) for k in told} for rank, (_, e) in sorted(running.items())})
    hosts = {rank: host_of(cluster, e) for rank, (_, e) in running.items()}
    assert hosts == {0: None, 1: None, 2: "127.0.0.2", 3: "127.0.0.2"}, hosts
    for rank, (_, e) in running.items():
        assert e["TORCHELASTIC_RUN_ID"] == run_id and e["WORLD_SIZE"] == "4", (rank, e)
        assert e["GROUP_RANK"] == str(rank // 2) and e["LOCAL_RANK"] == str(rank % 2)
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # see dsnd.distributed.elastic_store

    root = os.path.join(log_dir, "checkpoints")
    assert f"resumed from {root}/step_{KILL_AT:08d} at step {KILL_AT}" in whole, text
    rows = metrics_rows(log_dir)
    after = STEPS - KILL_AT
    first, again = rows[:-after], rows[-after:]
    assert [r["step"] for r in again] == list(range(KILL_AT + 1, STEPS + 1)), rows
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)), rows
    assert len(first) > KILL_AT
    assert_same_steps(again[: len(first) - KILL_AT], first[KILL_AT:])  # step KILL_AT + 1 at least
    want = {r["step"]: r["loss"] for r in reference}
    worst = max(abs(r["loss"] - want[r["step"]]) / abs(want[r["step"]]) for r in rows)
    print(f"torchrun job: {wall:.1f} s wall, losses max rel diff {worst:.2e} vs reference")
    assert [r["loss"] for r in rows] == pytest.approx([want[r["step"]] for r in rows], rel=1e-4)


@pytest.mark.launch
def test_sigterm_to_torchrun_reaches_every_worker_which_saves_one_step(tmp_path, reference):
    """Preemption: torchrun passes SIGTERM to its workers (then exits 1 itself, raising its
    SignalException); they stop after one same step and commit it."""
    tag, log_dir = uuid.uuid4().hex, str(tmp_path / "log")
    argv = [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "dsnd",
        "train",
        "--set",
        "parallel.pp=2",
        "--set",
        f"log.dir={log_dir}",
        *[a for s in SETS for a in ("--set", s)],
    ]
    agent = start(argv, rank_env({TAG: tag}), tmp_path / "agent.log")
    try:
        deadline = time.monotonic() + TIMEOUT
        while logged(log_dir) < 2:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step 2"
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=TIMEOUT)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    text = (tmp_path / "agent.log").read_text()
    assert code == 1 and "SignalException" in text, text[-4000:]
    rows = metrics_rows(log_dir)
    stopped = rows[-1]["step"]
    assert 2 <= stopped < STEPS and f"stopped at step {stopped} on request (SIGTERM)" in text
    with open(os.path.join(log_dir, "checkpoints", "latest")) as f:
        assert f.read() == f"step_{stopped:08d}\n"
    want = [r["loss"] for r in reference[:stopped]]
    assert [r["loss"] for r in rows] == pytest.approx(want, rel=1e-4)
    assert processes_with_env(TAG, tag) == []
