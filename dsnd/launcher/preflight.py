"""Checks `dsnd launch` makes on every host before any rank starts.

`python -m dsnd.launcher.preflight` runs on each host (over ssh, like an agent) with a JSON request
on stdin and prints a JSON report: its dsnd / DeepSpeed / torch versions, whether the rendezvous
port can still be bound (on the master host), and whether the checkpoint directory is the same
one the launcher sees (a marker file the launcher wrote there, read back with its content) and
writable. `problems` (pure) turns the reports into one line per problem.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import uuid
from importlib import metadata

MARKER_PREFIX = ".dsnd-preflight-"
PACKAGES = ("dsnd", "deepspeed", "torch")


def versions() -> dict[str, str]:
    """Installed versions of dsnd, DeepSpeed and torch, without importing the latter two."""
    import dsnd

    found = {"dsnd": dsnd.__version__}
    for name in PACKAGES[1:]:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def port_free(addr: str, port: int) -> bool:
    """Whether rank 0's rendezvous store can still listen on `port`.

    `addr` (the master address) only says which host asks: torch 2.13's TCPStore server listens
    on every address of its host, not on the master address (observed: with host 127.0.0.1 it
    shows as `*:PORT` in `ss -ltn` and as `[::]:PORT` in /proc/net/tcp6, IPv4-mapped; the same
    inside a network namespace with IPv6 disabled by sysctl; not in the suite). A listener on any
    local address and port (127.0.0.2:PORT, ::1:PORT) makes its bind fail, so the probe binds the
    way the store does: the IPv6 wildcard accepting IPv4 too, else (no IPv6 in the kernel) the IPv4
    wildcard, with SO_REUSEADDR like the store (a connection left in TIME_WAIT does not block it),
    then listens (a bind alone can coexist with another socket that is bound but not listening).
    """
    del addr  # see above: the store ignores it when it binds
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel: the store falls back to IPv4 as well
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind((wildcard, port))
                sock.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return False
                continue  # e.g. IPv6 sockets exist but cannot bind: try IPv4
            return True
    return False


def check_dir(path: str, marker: str, nonce: str) -> str | None:
    """None when `path` holds the launcher's marker (same storage) and takes a new file."""
    try:
        with open(os.path.join(path, marker), encoding="utf-8") as f:
            if f.read() != nonce:
                return "holds a different marker (not the launcher's directory)"
    except OSError:
        return "is not the launcher's (its marker file is missing: not shared storage?)"
    probe = os.path.join(path, f"{marker}-{uuid.uuid4().hex}")
    try:
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"is not writable ({e.strerror})"
    return None


def probe(request: dict) -> dict:
    """One host's report for `request` = {port, addr (or null), dir, marker, nonce}."""
    report: dict = {"versions": versions()}
    if request.get("addr"):
        report["port_free"] = port_free(request["addr"], request["port"])
    report["dir_problem"] = check_dir(request["dir"], request["marker"], request["nonce"])
    return report


def problems(reports: dict[str, dict | str], expected: dict[str, str], request: dict) -> list[str]:
    """One line per problem: a host that could not be asked (its report is the error text),
    versions unlike the launcher's, a busy rendezvous port, a checkpoint directory not shared
    or not writable."""
    lines = []
    for host, report in reports.items():
        if isinstance(report, str):
            lines.append(f"host {host}: unreachable: {report}")
            continue
        for name in PACKAGES:
            got = report["versions"].get(name)
            if got != expected[name]:
                lines.append(f"host {host}: {name} {got}, but the launcher has {expected[name]}")
        if report.get("port_free") is False:
            lines.append(
                f"host {host}: rendezvous port {request['addr']}:{request['port']} is "
                "in use (pick another with --master-port)"
            )
        if report["dir_problem"]:
            lines.append(
                f"host {host}: checkpoint directory {request['dir']} {report['dir_problem']}"
            )
    return lines


def main() -> int:
    """The probe as a remote process: one JSON request on stdin, one JSON report on stdout (the
    reply channel: nothing else may be written there)."""
    sys.stdout.write(json.dumps(probe(json.loads(sys.stdin.readline()))) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
