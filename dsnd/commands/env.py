"""``dsnd env``: what this machine would run with."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _mpirun_version() -> str:
    exe = shutil.which("mpirun")
    if not exe:
        return "mpirun not found"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{exe}: {e}"
    first = (out.stdout or out.stderr).strip().splitlines()
    return f"{first[0] if first else 'unknown'} ({exe})"


def run_env() -> int:
    import torch

    from dsnd import __version__
    from dsnd.distributed.init import resolve_backend
    from dsnd.engine.public import accelerator

    rows = [
        ("dsnd", __version__),
        ("python", sys.version.split()[0]),
        ("deepspeed", _version("deepspeed")),
        ("torch", torch.__version__),
        ("transformers", _version("transformers")),
        ("mpi4py", _version("mpi4py")),
        ("mpi", _mpirun_version()),
        ("accelerator", accelerator().device_name()),
        ("backend", resolve_backend("auto")),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd env`` takes no arguments."""
    return run_env()
