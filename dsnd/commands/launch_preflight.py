"""`dsnd launch`'s preflight: every host asked, before any rank starts, for its versions, the
rendezvous port (the master host) and the checkpoint directory (`dsnd.launcher.preflight` runs on
each host, over ssh like an agent); the answers as problems per host, so that an elastic job can
leave out the hosts that cannot serve and a fixed one can refuse to start."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import uuid

from dsnd.checkpoint.resume import checkpoint_root
from dsnd.checkpoint.root import probe_lock, run_dirs
from dsnd.commands.launch_argv import module_argv, only_this_machine
from dsnd.config.resolve import Resolved
from dsnd.launcher import preflight
from dsnd.launcher.supervisor import AgentLaunch

PREFLIGHT_TIMEOUT_S = 60


def _ask(argv: list[str], request: dict, timeout: float) -> dict | str:
    """A preflight report from one host, or the reason there is none."""
    try:
        proc = subprocess.run(
            argv,
            input=json.dumps(request) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        said = (proc.stderr.strip().splitlines() or [""])[-1]
        return f"{shlex.join(argv[:4])} ... exited with code {proc.returncode}: {said}".rstrip()


def host_problems(
    args: argparse.Namespace,
    launches: list[AgentLaunch],
    slots: dict[str, list[int]],
    res: Resolved,
    timeout: float = PREFLIGHT_TIMEOUT_S,
    port: bool = True,
) -> tuple[dict[str, list[str]], list[str]]:
    """({host: its problems, [] when it is ready}, this machine's own problems: a checkpoint
    directory it cannot write, one another run holds). The first host is asked whether the
    rendezvous port is free unless not `port` (hosts asked to rejoin a running job, whose
    rendezvous is in use). The marker file written in the checkpoint directory for the hosts to
    find is removed again."""
    root = os.path.abspath(checkpoint_root(res.run))
    marker, nonce = preflight.MARKER_PREFIX + uuid.uuid4().hex[:12], uuid.uuid4().hex
    path = os.path.join(root, marker)
    try:
        os.makedirs(root, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(nonce)
    except OSError as e:
        return {}, [f"checkpoint directory {root} is not writable here ({e.strerror or e})"]
    held = [
        line
        for path, what in run_dirs(root, os.path.abspath(res.run.log.dir))
        if (line := probe_lock(path, what))
    ]
    base = {"port": launches[0].spec.master_port, "dir": root, "marker": marker, "nonce": nonce}
    requests = {
        a.host: {**base, "addr": a.spec.master_addr if i == 0 and port else None}
        for i, a in enumerate(launches)
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(launches))) as pool:
            futures = {}
            for a in launches:
                if only_this_machine(slots):
                    futures[a.host] = pool.submit(preflight.probe, requests[a.host])
                else:
                    argv = module_argv(args, slots, a.host, "dsnd.launcher.preflight")
                    futures[a.host] = pool.submit(_ask, argv, requests[a.host], timeout)
            reports = {host: f.result() for host, f in futures.items()}
    finally:
        os.remove(path)
    request = {**base, "addr": launches[0].spec.master_addr}
    expected = preflight.versions()
    per_host = {
        host: preflight.problems({host: report}, expected, request)
        for host, report in reports.items()
    }
    return per_host, held


def run_preflight(
    args: argparse.Namespace,
    launches: list[AgentLaunch],
    slots: dict[str, list[int]],
    res: Resolved,
) -> list[str]:
    """Every problem any host or this machine has, one line each (none: ready to start)."""
    per_host, own = host_problems(args, launches, slots, res)
    return [line for lines in per_host.values() for line in lines] + own
