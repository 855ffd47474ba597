"""``dsnd launch``: check everything in this process, then start every rank, and see it through.

The whole config (YAML, DeepSpeed JSON, batch math, layout) is resolved for the launch's world
size before any rank starts, so a bad input costs one line and exit code 2, not a hung job.

With the default launcher (`dsnd`) every host runs a dsnd agent (`dsnd.launcher.agent`, over ssh
for remote hosts) that starts and watches its ranks; this process supervises the agents
(`dsnd.launcher.supervisor`). Before that, `preflight` asks every host for its versions, the
rendezvous port and the checkpoint directory. `--max-restarts N` relaunches a failed job from its
last committed checkpoint. The `pdsh`, `openmpi`, `mpich` and `slurm` launchers hand the job to
`deepspeed --hostfile`, `mpirun` or `srun` instead (restarts still apply; failure detection is
theirs, weaker: docs/launching.md, "Launching on a cluster"). With `slurm` the hosts are the
hostfile's (Slurm node names) or, without one, the allocation's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from dsnd.commands.launch_argv import (
    agent_launches,
    external_argv,
    step_name,
)
from dsnd.commands.launch_elastic import pinned_sets, run_elastic
from dsnd.commands.launch_preflight import run_preflight
from dsnd.commands.prestart import check_before_start, check_inputs
from dsnd.config.elastic import resolve_world
from dsnd.config.load import load
from dsnd.config.schema import RunConfig
from dsnd.distributed.slurm import derived_port
from dsnd.errors import EXIT_DIVERGED, UserError
from dsnd.launcher import command_lines
from dsnd.launcher.devices import ignored_note
from dsnd.launcher.environment import describe, passed_env
from dsnd.launcher.hostfile import (
    allocation_hosts,
    deepspeed_env_paths,
    parse_hostfile,
    read_deepspeed_env,
    select_slots,
)
from dsnd.launcher.local_ranks import free_port
from dsnd.launcher.protocol import aborted, describe_exit
from dsnd.launcher.rank_table import format_rank_table, rank_rows
from dsnd.launcher.supervisor import supervise
from dsnd.plan.plan import Plan, plan_json

DEFAULT_PORT = 29500


PATH_KEYS = ("data.path", "model.init_from", "checkpoint.dir", "checkpoint.export_hf", "log.dir")


def absolute_path_sets(run: RunConfig, sets: list[str], cwd: str) -> list[str]:
    """`--set KEY=/abs/path` for each relative path of the run config (and a relative
    `--set deepspeed=`), resolved against the launch's directory once: every attempt of the job
    then reads and writes the same files, even when that directory is gone by a restart."""
    values = {key: getattr(getattr(run, key.split(".")[0]), key.split(".")[1]) for key in PATH_KEYS}
    if run.checkpoint.resume not in ("auto", "never"):
        values["checkpoint.resume"] = run.checkpoint.resume
    if any(item.partition("=")[0].strip() == "deepspeed" for item in sets):
        values["deepspeed"] = run.deepspeed
    out = [
        f"{key}={os.path.join(cwd, value)}"
        for key, value in values.items()
        if value and not os.path.isabs(value)
    ]
    blend = run.data.blend
    if isinstance(blend, list) and any(_relative_entry(e) for e in blend):  # data.blend's files
        pinned = [
            {**e, "path": os.path.join(cwd, e["path"])} if _relative_entry(e) else e for e in blend
        ]
        out.append(f"data.blend={json.dumps(pinned)}")
    return out


def _relative_entry(entry: object) -> bool:
    """A `data.blend` entry naming a relative path (a malformed one is left for the check)."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and bool(entry["path"])
        and not os.path.isabs(entry["path"])
    )


def new_job_id() -> str:
    """A launch's job id: when it started, and random bits (unique across launches)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def _settle(args: argparse.Namespace) -> None:
    """Fix once what every attempt must share: the working directory and config path (a
    directory deleted mid-run must not stop a restart: os.getcwd() would fail then), the
    job id, and the rendezvous port (a free one for --nprocs, as torchrun --standalone does)."""
    args.cwd = os.getcwd()
    args.config = os.path.abspath(args.config) if args.config else None
    in_allocation = args.launcher == "slurm" and "SLURM_JOB_ID" in os.environ
    # a requeued Slurm job keeps its id, and so its own checkpoints
    args.job_id = os.environ["SLURM_JOB_ID"] if in_allocation else new_job_id()
    if args.master_port is None and in_allocation:
        args.master_port = derived_port(os.environ["SLURM_JOB_ID"])  # as srun's tasks would
    elif args.master_port is None:
        args.master_port = free_port() if args.nprocs is not None else DEFAULT_PORT
    elif not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port must be in 1..65535, got {args.master_port}")


def _slots(args: argparse.Namespace) -> dict[str, list[int]]:
    if args.nprocs is not None:
        if args.nprocs < 1:
            raise UserError(f"--nprocs must be >= 1, got {args.nprocs}")
        if args.include or args.exclude:
            raise UserError("--include/--exclude need --hostfile")
        return {"localhost": list(range(args.nprocs))}
    if args.hostfile is None:
        if args.launcher != "slurm":
            raise UserError(
                "dsnd launch needs --nprocs N or --hostfile FILE (or --launcher "
                "slurm inside a Slurm allocation)"
            )
        return select_slots(allocation_hosts(dict(os.environ)), args.include, args.exclude)
    hostfile = os.path.abspath(args.hostfile)
    return select_slots(parse_hostfile(hostfile), args.include, args.exclude)


def _stop_slurm_step(name: str) -> bool:
    """SIGTERM to every task of the job step `name` (srun itself, signalled, would end the step
    at once, where the tasks, signalled, save and stop after one same step); False when Slurm
    lists no such step (yet)."""
    found = subprocess.run(command_lines.squeue_steps_argv(name), capture_output=True, text=True)
    steps = found.stdout.split()
    if steps:
        subprocess.run(command_lines.scancel_argv("TERM", steps))
        return True
    print(
        f"dsnd: no running Slurm step named {name} to stop "
        f"({found.stderr.strip() or 'squeue lists none'}): signalling srun",
        file=sys.stderr,
    )
    return False


def _run(
    argv: list[str], env: dict[str, str], forwarded: list[str], slurm_step: str | None = None
) -> int:
    """Run an external launcher; Ctrl-C and SIGTERM are passed on to it (to the tasks of
    `slurm_step` with srun) and their names added to `forwarded`; its exit code is returned."""
    proc = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        forwarded.append(signal.Signals(signum).name)
        if slurm_step is None or not _stop_slurm_step(slurm_step):
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def with_restarts(
    attempt: Callable[[list[str]], tuple[str | None, bool]], sets: list[str], max_restarts: int
) -> int:
    """Run `attempt(sets)` -> (failure line or None, final) until it succeeds, or fails in a
    way a restart cannot mend (`final`: stopped on request, or training diverged), or
    `max_restarts` relaunches have failed too. Every attempt runs with the same `--job-id`, so
    a relaunch resumes the newest checkpoint this job committed (its ranks choose it: see
    `dsnd.checkpoint.resume`); before the job committed one, it starts as the first attempt did."""
    for i in range(max_restarts + 1):
        failure, final = attempt(sets)
        if failure is None:
            return 0
        if final or i == max_restarts:
            break
        print(
            f"dsnd: attempt {i + 1} of {max_restarts + 1} failed: {failure}; restarting from "
            "this job's last committed checkpoint",
            file=sys.stderr,
            flush=True,
        )
    print(f"dsnd: job failed: {failure}", file=sys.stderr, flush=True)
    return 1


def _print_plan(
    command: list[str],
    rows: list[dict],
    as_json: bool,
    agents: list[dict] | None = None,
    plan: Plan | None = None,
) -> int:
    """--dry-run: the command every rank (or the launcher) runs, each dsnd agent's command, the
    rank table and the run's plan (stages, schedule, a timeline per stage); as one JSON object
    with --json."""
    if as_json:
        out = {
            "command": command,
            **({"agents": agents} if agents is not None else {}),
            "world_size": len(rows),
            "ranks": rows,
        }
        if plan is not None:
            out["plan"] = plan_json(plan)
        print(json.dumps(out, indent=2))
        return 0
    print(shlex.join(command))
    for a in agents or []:
        print(f"agent on {a['host']}: {shlex.join(a['command'])}")
    print(format_rank_table(rows))
    for line in plan.describe() if plan is not None else []:
        print(line)
    return 0


def _check_elastic(args: argparse.Namespace, slots: dict[str, list[int]]) -> bool:
    """Whether the launch is elastic (--min-hosts); UserError for flags that cannot go with it.
    (Under Slurm or torchrun the run config's elastic.enabled makes every start choose its
    layout; the hosts are theirs to choose.)"""
    if args.rejoin and args.min_hosts is None:
        raise UserError("--rejoin needs --min-hosts (an elastic job)")
    if args.min_hosts is None:
        return False
    if args.launcher != "dsnd" or args.hostfile is None:
        raise UserError(
            "--min-hosts needs --hostfile and the dsnd launcher (under Slurm set "
            "elastic.enabled and submit with sbatch --nodes=MIN-MAX; under torchrun, "
            "elastic.enabled and --nnodes=MIN:MAX)"
        )
    if not 1 <= args.min_hosts <= len(slots):
        raise UserError(
            f"--min-hosts must be in 1..{len(slots)} (the hostfile's selected hosts), "
            f"got {args.min_hosts}"
        )
    return True


def run_launch(args: argparse.Namespace) -> int:
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    _settle(args)
    env_file = read_deepspeed_env(
        deepspeed_env_paths(
            os.path.expanduser("~"), args.cwd, os.environ.get("DS_ENV_FILE", ".deepspeed_env")
        )
    )
    slots = _slots(args)
    world = sum(len(s) for s in slots.values())
    if _check_elastic(args, slots):
        args.sets = pinned_sets(args.config, args.sets, world)
    res, elastic = resolve_world(load(args.config, args.sets), world)
    if elastic:  # (stderr: --dry-run --json prints the plan on stdout)
        print(f"dsnd: {elastic}", file=sys.stderr, flush=True)
    args.path_sets = absolute_path_sets(res.run, args.sets, args.cwd)
    rows = rank_rows(res.topology, command_lines.placement(slots))
    ignored = ignored_note(dict(os.environ), slots)
    if ignored and args.launcher in ("dsnd", "openmpi", "mpich"):  # DeepSpeed says it; Slurm binds
        print(f"dsnd: note: {ignored}", file=sys.stderr, flush=True)
    if args.launcher != "dsnd":
        return _launch_external(args, slots, env_file, rows, res)
    env = passed_env(dict(os.environ), res.run.launch.env, env_file)
    launches = agent_launches(args, slots, res, env, args.sets)
    if args.dry_run:
        check_inputs(res)
        agents = [{"host": a.host, "ranks": a.spec.ranks, "command": a.argv} for a in launches]
        return _print_plan(launches[0].spec.argv, rows, args.json, agents, res.plan)
    problems = [] if args.min_hosts is not None else run_preflight(args, launches, slots, res)
    if problems:
        for line in problems:
            print(f"dsnd: error: preflight: {line}", file=sys.stderr)
        return 2
    # the ranks' own checks, once here, so a bad input or checkpoint is one line before any
    # rank starts (a checkpoint given by path must verify; auto skips corrupt ones, warned)
    check_before_start(res, args.job_id)
    if env:
        print(f"dsnd: {describe(env)}", flush=True)
    print(f"dsnd: job {args.job_id}", flush=True)
    if args.min_hosts is not None:
        return run_elastic(args, slots, res, env)

    def attempt(sets: list[str]) -> tuple[str | None, bool]:
        result = supervise(agent_launches(args, slots, res, env, sets))
        return result.failure, result.stop_signal is not None or result.diverged

    return with_restarts(attempt, args.sets, args.max_restarts)


def _launch_external(args, slots, env_file, rows, res) -> int:
    argv = external_argv(args, slots, env_file, args.sets)
    if args.dry_run:
        check_inputs(res)
        return _print_plan(argv, rows, args.json, plan=res.plan)
    check_before_start(res, args.job_id)
    forwarded: list[str] = []

    def attempt(sets: list[str]) -> tuple[str | None, bool]:
        argv = external_argv(args, slots, env_file, sets)
        slurm_step = step_name(args.job_id) if args.launcher == "slurm" else None
        rc = _run(argv, {**os.environ, **env_file}, forwarded, slurm_step)
        said = describe_exit(rc) if aborted(rc) else f"exited with code {rc}"
        return (
            None if rc == 0 else f"{os.path.basename(argv[0])} {said}",
            bool(forwarded) or rc == EXIT_DIVERGED,
        )

    return with_restarts(attempt, args.sets, args.max_restarts)
