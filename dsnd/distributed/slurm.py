"""Slurm's view of a job, read from the variables `srun` gives every task. Pure functions.

A task started by `srun` knows its rank (SLURM_PROCID), its rank on its node (SLURM_LOCALID),
the step's size (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS) and nodes (SLURM_STEP_NODELIST, else
SLURM_JOB_NODELIST, in Slurm's hostlist syntax). Rank 0 runs on the first node of the step, so
that node is the rendezvous host unless MASTER_ADDR says otherwise. The rendezvous port is
MASTER_PORT, else one derived from the job id, so two jobs sharing a node do not collide.

A batch script (`sbatch`) has SLURM_PROCID=0 and SLURM_NTASKS too but is no job step
(no SLURM_STEP_ID): `dsnd train` run there directly would train alone while its allocation waits,
so that is refused.

The hostlist syntax is expanded here rather than by `scontrol show hostnames`: every rank would
otherwise ask the controller at start, and the syntax is small (`a[1-3,7],b[08-10]x`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dsnd.errors import UserError

PORT_BASE = 15000  # derived ports fall in 15000..24999: below Linux's ephemeral range
PORT_SPAN = 10000


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in hostlist {text!r}")
    return [*parts, current]


def _range(item: str, text: str) -> list[str]:
    """`08-10` -> ["08", "09", "10"] (zero padding kept); `7` -> ["7"]."""
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ValueError(f"bad range {item!r} in hostlist {text!r}")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"descending range {item!r} in hostlist {text!r}")
    width = len(lo) if lo.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_one(host: str, text: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", host)
    if match is None:
        if "[" in host or "]" in host:
            raise ValueError(f"unbalanced brackets in hostlist {text!r}")
        return [host]
    head, tail = host[: match.start()], host[match.end() :]
    out = []
    for item in match.group(1).split(","):
        for value in _range(item.strip(), text):
            out += _expand_one(head + value + tail, text)
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax, expanded in order: `n[1-2],g[08-09]` -> n1 n2 g08 g09."""
    return [host for part in _split_top(text.strip()) if part for host in _expand_one(part, text)]


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's syntax, one count per node: `2(x3),1` -> [2, 2, 2, 1]."""
    out = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"bad tasks-per-node item {item!r} in {text!r}")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return out


def derived_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job without MASTER_PORT: 15000 + the job id mod 10000."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def _get(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name, "").strip():
            return env[name].strip()
    raise UserError(f"running under Slurm (SLURM_PROCID is set) but {names[-1]} is not")


def _int(env: Mapping[str, str], *names: str) -> int:
    value = _get(env, *names)
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {names[0]}={value!r} is not an integer") from None


def in_step(env: Mapping[str, str]) -> bool:
    """Whether this process runs in a job step (srun), not in a batch script itself."""
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def slurm_world(env: Mapping[str, str]) -> tuple[int, int, int, str, int, bool] | None:
    """(rank, world, local rank, rendezvous host, port, every rank on one node) of a task that
    `srun` started, or None when this process is no Slurm task."""
    if "SLURM_PROCID" not in env:
        return None
    if not in_step(env):
        tasks = env.get("SLURM_NTASKS", "1").strip() or "1"
        if tasks != "1":
            raise UserError(
                f"dsnd train runs in a Slurm batch script outside a job step (SLURM_NTASKS="
                f"{tasks}, no SLURM_STEP_ID): start it with `srun python -m dsnd train ...` (see "
                "launch/sbatch_train.sh) or `dsnd launch --launcher slurm`"
            )
        return None
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    local = _int(env, "SLURM_LOCALID")
    nodelist = _get(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    try:
        nodes = expand_hostlist(nodelist)
    except ValueError as e:
        raise UserError(f"SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: {e}") from None
    addr = env.get("MASTER_ADDR") or nodes[0]
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        port = derived_port(str(_int(env, "SLURM_JOB_ID")))
    return rank, world, local, addr, port, len(nodes) == 1
