"""A test cluster on one machine: one real sshd listening on 127.0.0.1 .. 127.0.0.N.

Each loopback address plays one "host". Launchers reach them the way they reach real nodes: by
running plain `ssh HOST` from PATH (pdsh, Open MPI's plm_rsh agent and dsnd all do). `Cluster.env`
puts a wrapper directory first on PATH whose `ssh` adds this cluster's client config (port, key,
no host-key prompts), so no launcher needs to be told about ports or keys. Remote sessions get
this Python's bin directory first on PATH (sshd's `SetEnv`), as a shared environment would give
them on real nodes: `python`, `deepspeed` and Open MPI's `prted` resolve to this virtualenv.

Needs Debian's openssh-server (/usr/sbin/sshd, ssh-keygen, ssh) and pdsh; a missing one is a
RuntimeError naming it, never a skip (CI installs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "ssh-keygen"
# sshd refuses to start as root without its privilege-separation directory (Debian's service unit
# normally creates it)
PRIVSEP_DIR = "/run/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
READY_TIMEOUT_S = 10.0
# every file a cluster writes under its directory (launch/loopback_cluster.py adds `netns` and
# `hostfile`): stopping removes them, the private keys first of all
CREATED_FILES = (
    "id_ed25519",
    "id_ed25519.pub",
    "ssh_host_ed25519_key",
    "ssh_host_ed25519_key.pub",
    "authorized_keys",
    "sshd_config",
    "ssh_config",
    "bin/ssh",
    "sshd.pid",
    "sshd.log",
    "sshd.out",
    "netns",
    "hostfile",
)


@dataclass
class Cluster:
    hosts: list[str]  # ["127.0.0.1", "127.0.0.2"]
    env: dict[str, str]  # extra environment for any launcher command run against the cluster
    workdir: str
    port: int = 0
    sshd_log: str = ""
    netns: str | None = None  # the network namespace the cluster lives in (None: this one)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    # one sshd per host (start_cluster(per_host=True)): {host: its sshd}, so a host can go down
    host_procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    def stop_host(self, host: str) -> None:
        """Kill `host`'s own sshd (a per-host cluster): every later `ssh HOST` is refused, as
        for a host that went down. Sessions already open are the caller's to end."""
        proc = self.host_procs.pop(host)
        proc.kill()
        proc.wait()

    def start_host(self, host: str) -> None:
        """Start `host`'s own sshd again and return once `ssh HOST true` works."""
        self.host_procs[host] = _host_sshd(self, host)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.ssh(host, "true", timeout=READY_TIMEOUT_S).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd for {host} did not come back:\n{self.log_text()}")
            time.sleep(0.1)

    @property
    def prefix(self) -> list[str]:
        """Put in front of a command so that it runs where the hosts are (inside the netns)."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def hostfile(self, path: str, slots: int = 2) -> str:
        """Write a DeepSpeed hostfile (`HOST slots=N` per host) to `path`; return `path`."""
        with open(path, "w") as f:
            f.writelines(f"{host} slots={slots}\n" for host in self.hosts)
        return path

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run `command` on `host` through plain `ssh` from this cluster's PATH."""
        return subprocess.run(
            [*self.prefix, "ssh", host, command],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def log_text(self) -> str:
        """sshd's log, after anything it printed before its log was open."""
        text = ""
        for path in (os.path.join(self.workdir, "sshd.out"), self.sshd_log):
            try:
                with open(path) as f:
                    text += f.read()
            except OSError:
                pass
        return text

    def stop(self) -> None:
        """Stop sshd and wait for it (sessions still open end with their clients); remove the
        network namespace and the cluster's files (`remove_files`)."""
        for host in list(self.host_procs):
            self.stop_host(host)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        remove_files(self.workdir)


def remove_files(workdir: str) -> None:
    """Remove what a cluster wrote under `workdir` (`CREATED_FILES`: keys, configs, logs), then
    the directory itself if nothing else is left in it; anything else there is kept."""
    per_host = [n for n in _listdir(workdir) if n.startswith(("sshd_config-", "sshd-"))]
    for name in [*CREATED_FILES, *per_host]:
        try:
            os.remove(os.path.join(workdir, name))
        except FileNotFoundError:
            pass
    for folder in (os.path.join(workdir, "bin"), workdir):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (someone else's files) or already gone
            pass


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _require_tools() -> None:
    missing = []
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} (Debian package openssh-server)")
    for tool, package in ((SSH, "openssh-client"), (SSH_KEYGEN, "openssh-client")):
        if not shutil.which(tool):
            missing.append(f"{tool} (Debian package {package})")
    if not shutil.which("pdsh"):
        missing.append("pdsh (Debian package pdsh)")
    if missing:
        raise RuntimeError(
            "the loopback test cluster needs " + ", ".join(missing) + "; install with: "
            "apt-get install -y openssh-server pdsh"
        )


def _free_port(hosts: list[str]) -> int:
    """A TCP port free on every host address (not 22)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no TCP port free on every loopback host address")


def _path_first(*dirs: str) -> str:
    """This process's PATH with `dirs` moved to the front."""
    rest = [d for d in os.environ.get("PATH", SYSTEM_PATH).split(os.pathsep) if d not in dirs]
    return os.pathsep.join([*dirs, *rest])


def _keygen(path: str) -> None:
    if os.path.exists(path):
        return
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "dsnd-test-cluster", "-f", path],
        check=True,
        capture_output=True,
    )


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _setup_files(workdir: str, hosts: list[str], port: int) -> tuple[str, str]:
    """Keys, sshd and client configs, the `ssh` wrapper; (sshd config path, wrapper dir)."""
    host_key = os.path.join(workdir, "ssh_host_ed25519_key")
    user_key = os.path.join(workdir, "id_ed25519")
    _keygen(host_key)
    _keygen(user_key)
    authorized = os.path.join(workdir, "authorized_keys")
    shutil.copyfile(user_key + ".pub", authorized)
    os.chmod(authorized, 0o600)

    bindir = os.path.join(workdir, "bin")
    os.makedirs(bindir, exist_ok=True)
    venv_bin = os.path.dirname(sys.executable)
    remote_path = f"{bindir}:{venv_bin}:{SYSTEM_PATH}"
    sshd_config = os.path.join(workdir, "sshd_config")
    listen = "".join(f"ListenAddress {host}\n" for host in hosts)
    _write(
        sshd_config,
        f"""\
Port {port}
{listen}HostKey {host_key}
PidFile {os.path.join(workdir, "sshd.pid")}
AuthorizedKeysFile {authorized}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
X11Forwarding no
PrintMotd no
LogLevel VERBOSE
SetEnv PATH={remote_path}
""",
    )

    ssh_config = os.path.join(workdir, "ssh_config")
    _write(
        ssh_config,
        f"""\
Host *
    Port {port}
    IdentityFile {user_key}
    IdentitiesOnly yes
    BatchMode yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectTimeout 5
""",
    )
    _write(os.path.join(bindir, "ssh"), f'#!/bin/sh\nexec {SSH} -F {ssh_config} "$@"\n', mode=0o755)
    return sshd_config, bindir


def make_netns() -> str:
    """A new network namespace for the cluster; its name.

    Inside: `lo` (the hosts 127.0.0.1 .. 127.0.0.N) and a veth pair whose one end holds
    127.0.1.1/24, no IPv6. Open MPI 5's daemons (PRRTE) never use a loopback interface for their
    own traffic (only mpirun itself may, and only when nothing else exists), so they need a
    non-loopback interface; here it carries a loopback-range address of the namespace's own, and
    every byte of a test stays inside the namespace on 127.0.0.0/8.
    """
    name = f"dsnd-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    inside = ["ip", "netns", "exec", name]
    steps = [
        ["ip", "netns", "add", name],
        [*inside, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
        [*inside, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1"],
        [*inside, "ip", "link", "set", "lo", "up"],
        [*inside, "ip", "link", "add", "dsnd0", "type", "veth", "peer", "name", "dsnd1"],
        [*inside, "ip", "addr", "add", "127.0.1.1/24", "dev", "dsnd0"],
        [*inside, "ip", "link", "set", "dsnd0", "up"],
        [*inside, "ip", "link", "set", "dsnd1", "up"],
    ]
    for argv in steps:
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            raise RuntimeError(
                f"{' '.join(argv)} failed: {proc.stderr.strip()} (needs root and Debian's iproute2)"
            )
    return name


def start_cluster(
    workdir: str,
    nhosts: int = 2,
    port: int | None = None,
    netns: bool = True,
    per_host: bool = False,
) -> Cluster:
    """Start one sshd serving `nhosts` loopback "hosts" (127.0.0.1 ..), files under `workdir`.

    With `netns` (the default) the cluster lives in a network namespace of its own that has only
    a loopback interface: run commands against it with `cluster.prefix` in front. Open MPI's own
    daemons pick the first non-loopback interface for their traffic whenever one exists (they
    refuse `lo` then), so only there does every byte of a test stay on loopback addresses.

    Returns once `ssh HOST true` works for every host (bounded, ~10 s); raises RuntimeError with
    sshd's log otherwise. Without `port`, a free one is picked (again if another process takes
    it before sshd binds it).

    With `per_host`, each host has an sshd of its own (`Cluster.stop_host` takes one down,
    `Cluster.start_host` brings it back); otherwise one sshd listens on every host address.
    """
    _require_tools()
    if not 1 <= nhosts <= 254:
        raise ValueError(f"nhosts must be in 1..254, got {nhosts}")
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    hosts = [f"127.0.0.{i}" for i in range(1, nhosts + 1)]
    if os.geteuid() == 0:
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
    ns = make_netns() if netns else None
    for attempt in range(3):
        cluster = _start_sshd(workdir, hosts, port or _free_port(hosts), ns)
        if per_host:  # the shared sshd made the files; each host's own replaces it
            cluster._proc.terminate()
            cluster._proc.wait()
            cluster.host_procs = {h: _host_sshd(cluster, h) for h in hosts}
            cluster._proc = cluster.host_procs[hosts[0]]
        error = _wait_ready(cluster)
        if error is None:
            return cluster
        retry = port is None and "Address already in use" in error and attempt < 2
        if retry:
            cluster.netns = None  # keep the namespace for the next try
        cluster.stop()
        if not retry:
            raise RuntimeError(error)
    raise AssertionError("unreachable")


def _start_sshd(workdir: str, hosts: list[str], port: int, netns: str | None) -> Cluster:
    sshd_config, bindir = _setup_files(workdir, hosts, port)
    log = os.path.join(workdir, "sshd.log")
    open(log, "w").close()
    # its own session (a Ctrl-C meant for the caller does not reach it) and no inherited stdio
    # (a caller whose output is a pipe is not held open by a long-lived sshd)
    with open(os.path.join(workdir, "sshd.out"), "w") as out:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen(
            [*prefix, SSHD, "-D", "-f", sshd_config, "-E", log],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    env = {
        "PATH": _path_first(bindir, os.path.dirname(sys.executable)),
        "PDSH_RCMD_TYPE": "ssh",
    }
    return Cluster(hosts, env, workdir, port=port, sshd_log=log, netns=netns, _proc=proc)


def _host_sshd(cluster: Cluster, host: str) -> subprocess.Popen:
    """Start an sshd for `host` alone: the cluster's config, listening on that address only."""
    with open(os.path.join(cluster.workdir, "sshd_config")) as f:
        lines = f.read().splitlines()
    config = os.path.join(cluster.workdir, f"sshd_config-{host}")
    keep = [line for line in lines if not line.startswith(("ListenAddress ", "PidFile "))]
    pid = os.path.join(cluster.workdir, f"sshd-{host}.pid")
    _write(config, "\n".join([f"ListenAddress {host}", f"PidFile {pid}", *keep]) + "\n")
    with open(os.path.join(cluster.workdir, f"sshd-{host}.out"), "a") as out:
        prefix = ["ip", "netns", "exec", cluster.netns] if cluster.netns else []
        return subprocess.Popen(
            [
                *prefix,
                SSHD,
                "-D",
                "-f",
                config,
                "-E",
                os.path.join(cluster.workdir, f"sshd-{host}.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )


def _wait_ready(cluster: Cluster) -> str | None:
    """None once `ssh HOST true` works for every host, else what went wrong."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(cluster.hosts)
    last = ""
    while pending:
        assert cluster._proc is not None
        if cluster._proc.poll() is not None:
            return f"sshd exited with code {cluster._proc.returncode}:\n{cluster.log_text()}"
        if "Bind to port" in (log := cluster.log_text()):  # it keeps running on the others
            return f"sshd could not listen on every host address:\n{log}"
        try:
            res = cluster.ssh(pending[0], "true", timeout=READY_TIMEOUT_S)
            ok, last = res.returncode == 0, res.stderr
        except subprocess.TimeoutExpired:
            ok, last = False, "ssh timed out"
        if ok:
            pending.pop(0)
        elif time.monotonic() > deadline:
            return (
                f"`ssh {pending[0]} true` still fails after {READY_TIMEOUT_S:.0f} s: "
                f"{last.strip()}\nsshd log:\n{cluster.log_text()}"
            )
        else:
            time.sleep(0.1)
    return None


def environ_of(pid: int) -> dict[str, str]:
    """Process `pid`'s environment ({} if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    items = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {key: value for key, _, value in items}


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids on this machine (the caller excluded) whose environment holds KEY=VALUE: with a tag
    exported to every rank, the ranks (and launcher helpers) still alive, wherever they started.
    """
    wanted = f"{key}={value}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if wanted in entries:
            found.append(int(name))
    return sorted(found)
