"""``dsnd launch``: check everything in this process, then start every rank.

The whole config (YAML, DeepSpeed JSON, batch math, layout) is resolved for the launch's world
size before any rank starts, so a bad input costs one line and exit code 2, not a hung job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys

from dsnd.checkpoint.resume import choose_resume
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError
from dsnd.launch import commands
from dsnd.launch.hostfile import (
    deepspeed_env_paths,
    parse_hostfile,
    read_deepspeed_env,
    select_slots,
)
from dsnd.launch.rank_table import format_rank_table, rank_rows
from dsnd.pipeline.stage import check_stages

LOCALHOST = "127.0.0.1"


def _tool(name: str) -> str:
    """`name` from this Python's own bin/ (a virtualenv's deepspeed, openmpi's mpirun), else
    whatever PATH finds."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else name


def _only_this_machine(slots: dict[str, list[int]]) -> bool:
    """DeepSpeed runs a single selected host with its local launcher, even a remote one; dsnd
    forces the multi-node path unless that host really is this machine."""
    return len(slots) == 1 and next(iter(slots)) in ("localhost", LOCALHOST)


def _train_args(config: str | None, sets: list[str]) -> list[str]:
    args = ["--config", os.path.abspath(config)] if config else []
    for item in sets:
        args += ["--set", item]
    return args


def plan(args: argparse.Namespace) -> tuple[list[str], dict[str, list[int]], dict[str, str]]:
    """(argv, host -> slots, extra environment) for this launch; pure apart from file reads."""
    env_file = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    extra_env = read_deepspeed_env(
        deepspeed_env_paths(os.path.expanduser("~"), os.getcwd(), env_file)
    )
    train_args = _train_args(args.config, args.sets)
    if args.nprocs is not None:
        if args.nprocs < 1:
            raise UserError(f"--nprocs must be >= 1, got {args.nprocs}")
        if args.include or args.exclude:
            raise UserError("--include/--exclude need --hostfile")
        slots = {"localhost": list(range(args.nprocs))}
        addr = args.master_addr or LOCALHOST
        argv = commands.deepspeed_local_argv(args.nprocs, addr, args.master_port, train_args)
        return [_tool("deepspeed"), *argv[1:]], slots, extra_env
    hostfile = os.path.abspath(args.hostfile)
    slots = select_slots(parse_hostfile(hostfile), args.include, args.exclude)
    addr = args.master_addr or next(iter(slots))
    if args.launcher == "pdsh":
        argv = commands.deepspeed_hostfile_argv(
            hostfile, "pdsh", addr, args.master_port, args.include, args.exclude, train_args,
            force_multi=not _only_this_machine(slots),
        )  # fmt: skip
        return [_tool("deepspeed"), *argv[1:]], slots, extra_env
    argv = commands.mpirun_argv(
        args.launcher, slots, addr, args.master_port, extra_env, sys.executable, train_args,
        as_root=os.geteuid() == 0,
    )  # fmt: skip
    return [_tool("mpirun"), *argv[1:]], slots, extra_env


def run_launch(args: argparse.Namespace) -> int:
    argv, slots, extra_env = plan(args)
    world = sum(len(s) for s in slots.values())
    res = resolve(load(args.config, args.sets), world)
    check_stages(res)
    rows = rank_rows(res.topology, commands.placement(slots))
    if args.dry_run:
        if args.json:
            print(json.dumps({"command": argv, "world_size": world, "ranks": rows}, indent=2))
        else:
            print(shlex.join(argv))
            print(format_rank_table(rows))
        return 0
    # a checkpoint given by path must verify before any rank starts (exit 2 naming the file);
    # with auto, a corrupt one is skipped now (warned) and again by every rank
    choose_resume(res.run)
    return _run(argv, {**os.environ, **extra_env})


def _run(argv: list[str], env: dict[str, str]) -> int:
    """Run the launcher; Ctrl-C and SIGTERM are passed on to it, its exit code is ours."""
    proc = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if rc != 0:
        print(f"dsnd: launch failed: {os.path.basename(argv[0])} exited with code {rc}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
