"""Start real rank processes on this machine (gloo on loopback) and collect what they report.

Each rank is its own Python process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, exactly as DeepSpeed's launcher or torchrun would set them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One thread per rank, CPU accelerator, loopback only."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONUNBUFFERED="1")  # fmt: skip
    # ranks import the checkout under test, whatever else is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_ranks(
    world: int, argv: list[str], timeout: float = 300, cwd: str | None = None
) -> list[str]:
    """Run `python <argv>` as `world` ranks; returns each rank's output. The first rank to fail
    (or the deadline) kills the others, and every rank's output goes into the error."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = rank_env(dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))  # fmt: skip
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd or ROOT,
                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    deadline = time.monotonic() + timeout
    problem = None
    while problem is None and any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            problem = "a rank failed"
        elif time.monotonic() > deadline:
            problem = f"timed out after {timeout}s"
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if problem or any(p.returncode != 0 for p in procs):
        report = "\n".join(
            f"--- rank {r} (rc {p.returncode}) ---\n{o[-4000:]}"
            for r, (p, o) in enumerate(zip(procs, outputs, strict=True))
        )
        raise AssertionError(f"ranks failed ({problem or 'non-zero exit'}):\n{report}")
    return outputs


def run_cli(
    args: list[str], timeout: float = 600, cwd: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m dsnd <args>` as a real subprocess."""
    return subprocess.run([sys.executable, "-m", "dsnd", *args], cwd=cwd or ROOT,
                          env=rank_env(env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
