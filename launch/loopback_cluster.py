"""A test cluster on one machine, for trying multi-host launches by hand (tests/cluster.py).

One sshd serves 127.0.0.1 .. 127.0.0.N as N "hosts" inside a network namespace of its own
(needs root, openssh-server, pdsh and iproute2):

    python launch/loopback_cluster.py start [--hosts 2] [--dir /tmp/dsnd-loopback-cluster]
    # paste the printed `export ...` line; run launch commands inside the printed namespace, e.g.
    # (a .deepspeed_env in the current directory with OMP_NUM_THREADS=1 and DS_ACCELERATOR=cpu
    # carries the ranks' environment through pdsh and mpirun; dsnd's launcher also takes
    # `--set launch.env=[...]`):
    ip netns exec NAME dsnd launch --hostfile /tmp/dsnd-loopback-cluster/hostfile \
        --set train.steps=3 --set parallel.pp=2 [--launcher pdsh|openmpi]
    python launch/loopback_cluster.py stop [--dir /tmp/dsnd-loopback-cluster]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.cluster import remove_files, start_cluster  # noqa: E402

DEFAULT_DIR = "/tmp/dsnd-loopback-cluster"


def _running_pid(workdir: str) -> int | None:
    """The pid of this directory's sshd if it is still running (not a reused pid)."""
    try:
        with open(os.path.join(workdir, "sshd.pid")) as f:
            pid = int(f.read().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()  # sshd rewrites it: "sshd: /usr/sbin/sshd -D -f CONFIG ..."
    except (OSError, ValueError, IndexError):
        return None
    config = os.path.join(workdir, "sshd_config").encode()
    return pid if b"sshd" in cmdline and config in cmdline else None


def start(workdir: str, nhosts: int, slots: int) -> int:
    if (pid := _running_pid(workdir)) is not None:
        print(
            f"a cluster is already running from {workdir} (sshd pid {pid}); stop it first",
            file=sys.stderr,
        )
        return 1
    cluster = start_cluster(workdir, nhosts)  # sshd keeps running after this process exits
    with open(os.path.join(workdir, "netns"), "w") as f:
        f.write(f"{cluster.netns}\n")
    hostfile = cluster.hostfile(os.path.join(cluster.workdir, "hostfile"), slots=slots)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in cluster.env.items())
    print(f"hosts: {' '.join(cluster.hosts)} (sshd port {cluster.port}, log {cluster.sshd_log})")
    print(f"hostfile: {hostfile}")
    print(f"export {exports}")
    print(f"run launch commands inside: {shlex.join(cluster.prefix)} ...")
    return 0


def stop(workdir: str) -> int:
    """Stop the directory's sshd, delete its network namespace and remove every file `start`
    wrote there (the private key included), also when sshd is already gone."""
    pid = _running_pid(workdir)
    if pid is None:
        print(f"no cluster running from {workdir}")
    else:
        _terminate(pid, workdir)
        print(f"stopped sshd (pid {pid})")
    _remove_netns(workdir)
    _remove_files(workdir)
    return 0


def _terminate(pid: int, workdir: str) -> None:
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if _running_pid(workdir) is None:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _remove_files(workdir: str) -> None:
    if not os.path.isdir(workdir):
        return
    remove_files(workdir)
    kept = "" if not os.path.exists(workdir) else f" (kept: {', '.join(os.listdir(workdir))})"
    print(f"removed the cluster's keys, configs and logs from {workdir}{kept}")


def _remove_netns(workdir: str) -> None:
    try:
        with open(os.path.join(workdir, "netns")) as f:
            name = f.read().strip()
    except OSError:
        return
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    os.remove(os.path.join(workdir, "netns"))
    print(f"removed network namespace {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--dir", default=DEFAULT_DIR, help="keys, configs, hostfile, sshd log")
    parser.add_argument("--hosts", type=int, default=2, help="number of loopback hosts")
    parser.add_argument("--slots", type=int, default=2, help="slots per host in the hostfile")
    args = parser.parse_args()
    workdir = os.path.abspath(args.dir)
    return start(workdir, args.hosts, args.slots) if args.action == "start" else stop(workdir)


if __name__ == "__main__":
    sys.exit(main())
