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
    launch.add_argument(
        "--min-hosts",
        type=int,
        help="elastic (the dsnd launcher, with --hostfile): each start runs on the hosts that "
        "answer, at least K of them, on a layout chosen for their ranks with the same global "
        "batch (elastic.enabled); a lost host is dropped at the next restart, one that answers "
        "again taken back",
    )
    launch.add_argument(
        "--rejoin",
        action="store_true",
        help="with --min-hosts: while hosts are missing, ask them every few seconds; when one "
        "answers, save at the next step and restart on the larger world (not a counted restart)",
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
