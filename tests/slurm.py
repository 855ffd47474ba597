"""A real Slurm on this machine: munged, slurmctld and one slurmd per "node" (127.0.0.1, ...).

Debian's slurm-wlm 22.05 runs several slurmd on one host when each is started as its node
(`slurmd -N NAME`) with its own port, spool directory and pid file (`%n` in slurm.conf): so every
node here is a real slurmd, at its own loopback address, named by that address (the names
`srun` hands its tasks in SLURM_STEP_NODELIST then resolve without /etc/hosts, and match the
host names of tests/cluster.py's hostfiles). Everything lives under one work directory: its own
munge key and socket, slurm.conf, state and logs; no system file is touched. Commands reach
this Slurm through `SlurmCluster.env` (SLURM_CONF). No cgroups (proctrack/linuxproc), no
accounting database: a job's end state is read from `scontrol show job`.

Needs Debian's slurm-wlm and munge; a missing one is a RuntimeError naming it, never a skip
(.ci/run installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

DAEMONS = {
    "munged": "/usr/sbin/munged",
    "slurmctld": "/usr/sbin/slurmctld",
    "slurmd": "/usr/sbin/slurmd",
}
READY_TIMEOUT_S = 30.0


@dataclass
class SlurmCluster:
    hosts: list[str]  # Slurm node names = their addresses: ["127.0.0.1", "127.0.0.2"]
    workdir: str
    env: dict[str, str]  # SLURM_CONF for every Slurm command run against this cluster

    def run(
        self, *argv: str, timeout: float = 30, env: dict[str, str] | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scancel, scontrol ...) against this cluster,
        in this process's environment plus `env`."""
        return subprocess.run(
            list(argv),
            env={**os.environ, **(env or {}), **self.env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id)).get("JobState") not in states:
            assert time.monotonic() < deadline, f"job {job_id} not {states} in {timeout} s: {info}"
            time.sleep(0.5)
        return info

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (registered, no job on it)."""
        deadline, idle = time.monotonic() + timeout, ["idle"] * len(self.hosts)
        while self.run("sinfo", "--noheader", "--format=%t", "--Node").stdout.split() != idle:
            assert time.monotonic() < deadline, f"nodes not idle in {timeout} s"
            time.sleep(0.2)

    def log_text(self) -> str:
        logs = os.path.join(self.workdir, "log")
        return "\n".join(
            f"== {name}\n{open(os.path.join(logs, name)).read()[-3000:]}"
            for name in sorted(os.listdir(logs))
        )

    def stop(self) -> None:
        """Cancel every job, stop the daemons, remove the work directory's files."""
        self.run("scancel", "--full", "--signal=KILL", "--partition=debug")
        for name in ("slurmd", "slurmctld", "munged"):
            for pid_file in sorted(os.listdir(self.workdir)):
                if pid_file.startswith(name) and pid_file.endswith(".pid"):
                    _kill(os.path.join(self.workdir, pid_file))
        shutil.rmtree(self.workdir, ignore_errors=True)


def _kill(pid_file: str) -> None:
    """SIGTERM, then SIGKILL after a second (the jobs are cancelled already)."""
    try:
        pid = int(open(pid_file).read().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    for _ in range(20):
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _free_ports(count: int, hosts: list[str]) -> list[int]:
    """`count` TCP ports free on every host address."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        if port not in ports:
            ports.append(port)
    return ports


def slurm_conf(workdir: str, hosts: list[str], cpus: int, ports: list[int]) -> str:
    """slurm.conf for one controller on 127.0.0.1 and a slurmd per host (ports[0] the
    controller's, ports[1:] the nodes')."""
    me = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={h} NodeAddr={h} NodeHostname={me} CPUs={cpus} Port={port} State=UNKNOWN"
        for h, port in zip(hosts, ports[1:], strict=True)
    )
    return f"""ClusterName=dsndtest
SlurmctldHost={me}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
# a job credential lives 10 s (default 120): also how long Slurm holds a requeued job; the
# scheduler looks for jobs that became eligible every second (default 60: measured, a requeued
# job then started 27 s after its requeue, with 1 s 11 s)
SchedulerParameters=sched_interval=1
AuthInfo=socket={workdir}/munge.socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={workdir}/spool/ctld
SlurmdSpoolDir={workdir}/spool/%n
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.%n.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd.%n.log
# the nodes' CPUs as configured (several slurmd share this machine's cores)
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# a step being killed (a task failed under --kill-on-bad-exit) gets SIGKILL 5 s after SIGTERM
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(hosts)} Default=YES MaxTime=INFINITE State=UP
"""


def start_slurm(workdir: str, nhosts: int = 2, cpus: int = 2) -> SlurmCluster:
    """munged + slurmctld + `nhosts` slurmd, each node offering `cpus` task slots; waits until
    every node is idle."""
    for name, path in DAEMONS.items():
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} ({name}) is missing: apt-get install slurm-wlm munge")
    hosts = [f"127.0.0.{i + 1}" for i in range(nhosts)]
    os.makedirs(os.path.join(workdir, "log"), exist_ok=True)
    for sub in ["ctld", *hosts]:
        os.makedirs(os.path.join(workdir, "spool", sub), exist_ok=True)
    key = os.path.join(workdir, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = os.path.join(workdir, "slurm.conf")
    with open(conf, "w") as f:
        f.write(slurm_conf(workdir, hosts, cpus, _free_ports(nhosts + 1, hosts)))
    cluster = SlurmCluster(hosts, workdir, {"SLURM_CONF": conf})
    starts = [
        [
            DAEMONS["munged"],
            "--force",
            f"--socket={workdir}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={workdir}/munged.pid",
            f"--log-file={workdir}/log/munged.log",
            f"--seed-file={workdir}/munged.seed",
        ],
        [DAEMONS["slurmctld"], "-f", conf],
        *([DAEMONS["slurmd"], "-f", conf, "-N", h] for h in hosts),
    ]
    try:
        for argv in starts:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr}")
        try:
            cluster.wait_idle(READY_TIMEOUT_S)
        except AssertionError as e:
            raise RuntimeError(f"Slurm did not start: {e}\n{cluster.log_text()}") from None
        return cluster
    except BaseException:
        cluster.stop()
        raise
