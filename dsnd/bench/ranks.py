"""Start a benchmark's rank processes on this machine: gloo over loopback, one thread each.

Each rank is its own Python process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, as DeepSpeed's launcher or torchrun would set them. The first rank to fail, or
the deadline, ends the others; their output is kept for the error message.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the deadline passed; the message holds every rank's output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
    )  # fmt: skip
    # the ranks import the same dsnd as this process, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


def run_ranks(world: int, argv: Sequence[str], timeout_s: float) -> None:
    """Run ``python <argv>`` as `world` ranks and wait for all of them."""
    port = free_port()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=rank_env(rank, world, port),
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for rank, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout_s
    problem = None
    try:
        while problem is None and any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                problem = "a rank failed"
            elif time.monotonic() > deadline:
                problem = f"timed out after {timeout_s:.0f}s"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if problem is None and all(p.returncode == 0 for p in procs):
        for log in logs:
            log.close()
        return
    report = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        report.append(f"--- rank {rank} (exit code {p.returncode}) ---\n{log.read()[-4000:]}")
        log.close()
    raise RanksFailed(f"{problem or 'a rank failed'}:\n" + "\n".join(report))
