"""What `dsnd launch` (`dsnd.commands.launch`) starts: the argv of an external launcher
(`deepspeed`, `mpirun`, `srun`), and one dsnd agent per host with the ranks it runs."""

from __future__ import annotations

import argparse
import os
import sys

from dsnd.config.resolve import Resolved
from dsnd.launcher import command_lines
from dsnd.launcher.protocol import AgentSpec
from dsnd.launcher.supervisor import AgentLaunch

LOCALHOST = "127.0.0.1"


def _tool(name: str) -> str:
    """`name` from this Python's own bin/ (a virtualenv's deepspeed, openmpi's mpirun), else
    whatever PATH finds."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else name


def only_this_machine(slots: dict[str, list[int]]) -> bool:
    """A single selected host that is this machine runs without ssh (DeepSpeed does the same;
    for pdsh dsnd forces the multi-node path otherwise, as DeepSpeed would run even a remote
    single host locally)."""
    return len(slots) == 1 and next(iter(slots)) in ("localhost", LOCALHOST)


def _train_args(args: argparse.Namespace, sets: list[str]) -> list[str]:
    """`dsnd train` arguments of every rank: the config (made absolute once, at the start), the
    `--set`s, their relative paths made absolute, and the job id every attempt shares."""
    out = ["--config", args.config] if args.config else []
    for item in [*sets, *args.path_sets]:
        out += ["--set", item]
    return [*out, "--job-id", args.job_id]


def _master_addr(args: argparse.Namespace, slots: dict[str, list[int]]) -> str:
    if args.master_addr:
        return args.master_addr
    first = next(iter(slots))
    return LOCALHOST if first == "localhost" else first


def external_argv(
    args: argparse.Namespace, slots: dict[str, list[int]], env: dict[str, str], sets: list[str]
) -> list[str]:
    """`deepspeed`, `mpirun` or `srun` argv for the pdsh / openmpi / mpich / slurm launchers."""
    train_args = _train_args(args, sets)
    addr = _master_addr(args, slots)
    if args.launcher == "slurm":
        argv = command_lines.srun_argv(
            None if args.nprocs is not None else slots,
            args.nprocs,
            addr,
            args.master_port,
            step_name(args.job_id),
            sys.executable,
            train_args,
        )
        return [_tool("srun"), *argv[1:]]
    if args.nprocs is not None:
        argv = command_lines.deepspeed_local_argv(args.nprocs, addr, args.master_port, train_args)
        return [_tool("deepspeed"), *argv[1:]]
    if args.launcher == "pdsh":
        argv = command_lines.deepspeed_hostfile_argv(
            os.path.abspath(args.hostfile),
            "pdsh",
            addr,
            args.master_port,
            args.include,
            args.exclude,
            train_args,
            force_multi=not only_this_machine(slots),
        )
        return [_tool("deepspeed"), *argv[1:]]
    argv = command_lines.mpirun_argv(
        args.launcher,
        slots,
        addr,
        args.master_port,
        env,
        sys.executable,
        train_args,
        as_root=os.geteuid() == 0,
    )
    return [_tool("mpirun"), *argv[1:]]


def agent_launches(
    args: argparse.Namespace,
    slots: dict[str, list[int]],
    res: Resolved,
    env: dict[str, str],
    sets: list[str],
) -> list[AgentLaunch]:
    """One dsnd agent per host: where it runs and what it starts (ranks in placement order)."""
    program = [sys.executable, "-u", "-m", "dsnd", "train", *_train_args(args, sets)]
    world = sum(len(s) for s in slots.values())
    launches, first = [], 0
    for host, host_slots in slots.items():
        ranks = list(range(first, first + len(host_slots)))
        first += len(host_slots)
        spec = AgentSpec(
            host,
            ranks,
            world,
            _master_addr(args, slots),
            args.master_port,
            program,
            args.cwd,
            env,
            res.run.dist.timeout_s,
            devices=host_slots,
        )
        argv = module_argv(args, slots, host, "dsnd.launcher.agent")
        launches.append(AgentLaunch(host, argv, spec))
    return launches


def module_argv(
    args: argparse.Namespace, slots: dict[str, list[int]], host: str, module: str
) -> list[str]:
    remote = None if only_this_machine(slots) else host
    return command_lines.python_module_argv(
        remote, sys.executable, module, args.cwd, os.environ.get("PYTHONPATH")
    )


def step_name(job_id: str) -> str:
    """The name of the Slurm job step a launch starts (how a stop request finds it)."""
    return f"dsnd-{job_id}"
