"""``dsnd launch``: the run config, where the ranks run and how they are started."""

from __future__ import annotations

import argparse

from dsnd.commands.args.common import add_config_args


def add_arguments(launch: argparse.ArgumentParser) -> None:
    add_config_args(launch)
    where = launch.add_mutually_exclusive_group()
    where.add_argument("--nprocs", type=int, help="ranks on this machine (deepspeed --num_gpus)")
    where.add_argument("--hostfile", help="DeepSpeed hostfile: 'HOST slots=N' per line")
    launch.add_argument(
        "--launcher",
        choices=("dsnd", "pdsh", "openmpi", "mpich", "slurm"),
        default="dsnd",
        help="dsnd (default): a dsnd agent per host (ssh) supervises its ranks; pdsh: deepspeed "
        "--hostfile; openmpi, mpich: mpirun; slurm: srun (hosts: --hostfile's Slurm node names, "
        "else the allocation's)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="relaunch a failed job up to N times from its last committed checkpoint",
    )
    launch.add_argument("--include", help="DeepSpeed resource filter, e.g. host1@host2:0,1")
    launch.add_argument("--exclude", help="DeepSpeed resource filter")
    launch.add_argument("--master-addr", help="rendezvous address (default: the first host)")
    launch.add_argument(
        "--master-port",
        type=int,
        help="rendezvous port (default: a free port for --nprocs, 29500 with --hostfile)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    launch.add_argument("--json", action="store_true", help="with --dry-run: machine-readable")
