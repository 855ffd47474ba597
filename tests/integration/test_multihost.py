"""Multi-host launches across the loopback cluster (127.0.0.1 and 127.0.0.2, one real sshd):
`dsnd launch --hostfile` through DeepSpeed's pdsh runner and through Open MPI's mpirun.

llama-tiny, pp=1 x dp=4 at ZeRO-3: 4 ranks, 2 per host, 3 steps; each launch also carries one
of the sharding degrees that must keep to a host (a launch across hosts costs seconds, so they
share): pdsh hybrid sharding (`parallel.dp_shard=2`), mpirun ZeRO++ hpZ. Both launches must
match the single-process plain-PyTorch reference (so each other) to rel 1e-4. (pp=2 across
hosts: tests/integration/test_launch_faults.py and test_slurm.py.)

The ranks' environment comes only through the launchers' own mechanisms: a `.deepspeed_env` in
the launch's working directory (OMP_NUM_THREADS, DS_ACCELERATOR, PYTHONPATH, and a tag unique to
the launch); the launching command itself runs without OMP_NUM_THREADS / DS_ACCELERATOR. While a
launch runs, every process carrying its tag is inspected in /proc: each rank's environment must
hold the `.deepspeed_env` values, and ranks 2 and 3 must have been started inside an ssh session
to 127.0.0.2 (SSH_CONNECTION names that address and the cluster's sshd port). No tagged process
may outlive the launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.plan.memory import model_state_bytes
from tests.cluster import Cluster, environ_of, processes_with_env
from tests.procs import ROOT, free_port, last_log_text, rank_env

TIMEOUT = 240
STEPS = 3
TAG = "DSND_TEST_LAUNCH"
# kept out of the launching command's environment: the ranks must get them from .deepspeed_env
VIA_ENV_FILE = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT}


def _argv_of(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _is_rank(argv: list[str]) -> bool:
    """`python [-u] -m dsnd [--local_rank=N] train ...` (not DeepSpeed's launch.py, a compiler
    child or a pre-exec fork of a tagged parent)."""
    return "-m" in argv[:3] and argv[argv.index("-m") + 1 :][:1] == ["dsnd"] and "train" in argv


class RankWatcher(threading.Thread):
    """Records the environment of every rank process carrying `TAG=tag` while a launch runs."""

    def __init__(self, tag: str):
        super().__init__(daemon=True)
        self.tag = tag
        self.ranks: dict[int, dict[str, str]] = {}  # global rank -> its environment
        self._seen: set[int] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.25):
            for pid in processes_with_env(TAG, self.tag):
                if pid in self._seen or not _is_rank(_argv_of(pid)):
                    continue
                env = environ_of(pid)
                rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK"))
                if rank is not None:
                    self._seen.add(pid)
                    self.ranks[int(rank)] = env

    def stop(self) -> None:
        self._done.set()
        self.join()


def _kill_tagged(tag: str) -> None:
    for pid in processes_with_env(TAG, tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_no_tagged(tag: str, within_s: float = 15) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := processes_with_env(TAG, tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def launch_on_cluster(
    cluster: Cluster, tmp_path, launcher: str, sets: tuple[str, ...] = ()
) -> tuple[RankWatcher, str]:
    """`dsnd launch --hostfile --launcher LAUNCHER`, pp=2 x dp=2 over both hosts (then `sets`),
    from a working directory holding the `.deepspeed_env`; (the rank watcher, log.dir). Asserts
    exit 0."""
    work = tmp_path / "work"
    work.mkdir()
    tag = uuid.uuid4().hex
    (work / ".deepspeed_env").write_text(
        "".join(f"{k}={v}\n" for k, v in {**VIA_ENV_FILE, TAG: tag}.items())
    )
    hostfile = cluster.hostfile(str(tmp_path / "hostfile"), slots=2)
    log_dir = str(tmp_path / "log")
    argv = [
        sys.executable,
        "-m",
        "dsnd",
        "launch",
        "--hostfile",
        hostfile,
        "--launcher",
        launcher,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--set",
        f"train.steps={STEPS}",
        "--set",
        "parallel.pp=2",
        "--set",
        f"log.dir={log_dir}",
        *[a for item in sets for a in ("--set", item)],
    ]
    env = {k: v for k, v in rank_env(cluster.env).items() if k not in VIA_ENV_FILE}
    # the launching `python -m dsnd` itself must import this checkout, not an installed dsnd
    env["PYTHONPATH"] = ROOT
    watcher = RankWatcher(tag)
    watcher.start()
    proc = subprocess.Popen(
        [*cluster.prefix, *argv],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[test] timed out after {TIMEOUT}s"
    finally:
        watcher.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftover = _wait_no_tagged(tag)
        _kill_tagged(tag)  # remote ranks live in sshd's sessions, outside the launcher's group
    assert proc.returncode == 0, out[-4000:] + "\nsshd log:\n" + cluster.log_text()[-2000:]
    assert not leftover, f"processes outlived the launch: {leftover}"
    return watcher, log_dir


def check_run(
    cluster: Cluster,
    watcher: RankWatcher,
    log_dir: str,
    reference: list[float],
    first_host_ranks: str | None,
) -> None:
    """Losses equal the reference; all 4 ranks got the env file's values; ranks 2 and 3 ran in
    ssh sessions to 127.0.0.2, ranks 0 and 1 on `first_host_ranks` (127.0.0.1 through ssh, or
    None: started by the launcher directly)."""
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(reference, rel=1e-4)
    for rank in range(4):
        assert os.path.isfile(os.path.join(log_dir, "logs", f"rank_{rank:05d}.log"))

    assert sorted(watcher.ranks) == [0, 1, 2, 3], f"ranks seen running: {sorted(watcher.ranks)}"
    for rank, env in watcher.ranks.items():
        for key, value in VIA_ENV_FILE.items():
            assert env.get(key) == value, f"rank {rank}: {key}={env.get(key)!r}"

    def host_of(env: dict[str, str]) -> str | None:
        conn = env.get("SSH_CONNECTION", "").split()  # client_ip client_port server_ip port
        return conn[2] if len(conn) == 4 and conn[3] == str(cluster.port) else None

    hosts = {rank: host_of(env) for rank, env in watcher.ranks.items()}
    want = {0: first_host_ranks, 1: first_host_ranks, 2: "127.0.0.2", 3: "127.0.0.2"}
    assert hosts == want, "ssh session each rank ran in (None: none of the cluster's)"


ZERO3_DP4 = ("parallel.pp=1", f"deepspeed={os.path.join(ROOT, 'ds_configs', 'zero3.json')}")
"""pp=1 x dp=4 at ZeRO-3 (what both launches run, with their sharding degree)."""


@pytest.mark.launch
def test_deepspeed_pdsh_across_two_hosts_hsdp_shards_on_each_host(
    cluster, tmp_path, reference_losses
):
    """`deepspeed --hostfile --launcher pdsh --force_multi`: pdsh sshes to both hosts (this one
    too) and starts DeepSpeed's launch.py there, which starts that host's 2 ranks. The run
    shards ZeRO-3 over each host's two ranks (`parallel.dp_shard=2`): parameter all-gathers stay
    inside a host, only gradient partitions cross hosts, and each rank holds ZeRO-3's model
    states over 2 ranks: bytes / ((4 + 4 + 4 + 8) * Psi / 2) near 1."""
    hsdp = (*ZERO3_DP4, "parallel.dp_shard=2")
    watcher, log_dir = launch_on_cluster(cluster, tmp_path, "pdsh", sets=hsdp)
    check_run(cluster, watcher, log_dir, reference_losses, first_host_ranks="127.0.0.1")
    # ranks 0, 1 ran on 127.0.0.1 and ranks 2, 3 on 127.0.0.2 (checked), so each shard group
    # below is one host's ranks and each replica group one rank of each host
    assert [last_log_text(log_dir, rank, "HSDP: ") for rank in range(4)] == [
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [1, 3]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [1, 3]",
    ]
    res = resolve(load(None, list(hsdp)), 4)
    psi = res.plan.stage_parameters(res.model)[0]
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        live = max(json.loads(line)["memory_live_bytes"] for line in f)
    ratio = live / sum(model_state_bytes(3, psi, 2, bf16=False)["device"].values())
    print(f"HSDP on 2 hosts: model-state bytes per rank / (20 * {psi} / 2) = {ratio:.3f}")
    assert 0.95 < ratio < 1.10, ratio


@pytest.mark.launch
def test_openmpi_mpirun_across_two_hosts_hpz_partition_on_each_host(
    cluster, tmp_path, reference_losses
):
    """`mpirun --host 127.0.0.1:2,127.0.0.2:2`: ranks 0 and 1 start under mpirun here, Open MPI
    sshes to 127.0.0.2 to start its daemon (prted), which starts ranks 2 and 3. The run uses
    ZeRO++ hpZ (`zero_hpz_partition_size: 2`): each host's two ranks hold the parameters'
    secondary partition between them (its all-gathers stay inside a node)."""
    hpz = (*ZERO3_DP4, "ds.zero_optimization.zero_hpz_partition_size=2")
    watcher, log_dir = launch_on_cluster(cluster, tmp_path, "openmpi", sets=hpz)
    check_run(cluster, watcher, log_dir, reference_losses, first_host_ranks=None)
    # ranks 0, 1 ran on this host and ranks 2, 3 on 127.0.0.2 (checked), so each hpZ group
    # below is one host's ranks
    texts = [last_log_text(log_dir, rank, "ZeRO++ hpZ: ") for rank in range(4)]
    groups = [text.rsplit("over ranks ", 1)[1] for text in texts]
    assert groups == ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"]
