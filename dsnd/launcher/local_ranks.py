"""Start rank processes on this machine: gloo over loopback, one thread each (benchmarks, tests).

Each rank is its own Python process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, as DeepSpeed's launcher or torchrun would set them. The first rank to fail, or
the deadline, ends the others; their output is kept for the error message.

The ranks run on DeepSpeed's CPU accelerator unless told otherwise, even on a GPU machine: the
CPU benches, the tests and `dsnd plan --validate` start 2-4 ranks here, which NCCL would refuse
on one GPU. They see no GPU either (CUDA_VISIBLE_DEVICES empty), so nothing in them opens a CUDA
context, and `dist.backend: auto` is gloo for them (`dsnd.distributed.init.backend_for`).
`dsnd bench gpu` asks for the CUDA accelerator for its one rank, which then sees the GPUs this
process sees (its device 0 is the one the bench named).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from dsnd.extensions import use_environment_dir

LOOPBACK = "127.0.0.1"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the deadline passed; the message holds every rank's output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def accelerator_env(accelerator: str) -> dict[str, str]:
    """DeepSpeed's accelerator for the ranks (`cpu` or `cuda`), and for `cpu` no visible GPU."""
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if accelerator == "cpu" else {}
    return {"DS_ACCELERATOR": accelerator, **hidden}


def base_env(extra: dict[str, str] | None = None, accelerator: str = "cpu") -> dict[str, str]:
    """This environment with one thread per process, DeepSpeed's `accelerator` (`cpu`: no GPU
    visible), unbuffered output, and this process's own dsnd first on the path (installed or
    not)."""
    env = dict(os.environ)
    use_environment_dir(env)  # the same DeepSpeed op builds as `dsnd` itself uses
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(accelerator_env(accelerator))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def rank_env(rank: int, world: int, port: int, accelerator: str = "cpu") -> dict[str, str]:
    return base_env(
        dict(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=LOOPBACK,
            MASTER_PORT=str(port),
        ),
        accelerator,
    )


def run_ranks(
    world: int,
    argv: Sequence[str],
    timeout_s: float,
    cwd: str | None = None,
    accelerator: str = "cpu",
) -> list[str]:
    """Run ``python <argv>`` as `world` ranks on DeepSpeed's `accelerator`, wait for all of
    them, return their outputs."""
    port = free_port()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=rank_env(rank, world, port, accelerator),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return checked_outputs(outputs, [p.returncode for p in procs], problem)


def checked_outputs(
    outputs: list[str], codes: Sequence[int | None], problem: str | None
) -> list[str]:
    """The ranks' `outputs` when there is no `problem` and every exit code is 0; else
    RanksFailed with the problem and every rank's exit code and output's end."""
    if problem is None and all(c == 0 for c in codes):
        return outputs
    report = [
        f"--- rank {rank} (exit code {c}) ---\n{out[-4000:]}"
        for rank, (c, out) in enumerate(zip(codes, outputs, strict=True))
    ]
    raise RanksFailed(f"{problem or 'a rank failed'}:\n" + "\n".join(report))
