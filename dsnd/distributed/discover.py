"""Which world is this process in? Pure reading of the launcher's environment.

Sources, first match wins:
  env://       RANK / WORLD_SIZE / LOCAL_RANK (DeepSpeed's launcher, torchrun)
  Open MPI     OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (+ _LOCAL_SIZE)
  MPICH/Intel  PMI_RANK / PMI_SIZE / MPI_LOCALRANKID (+ MPI_LOCALNRANKS)
  Slurm        SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID / SLURM_STEP_NODELIST
               (a task `srun` started: see `dsnd.distributed.slurm`)
  mpi4py       when only PMIx/Hydra traces are present (see `dsnd.distributed.init`)
  single       none of the above: a world of one.

DeepSpeed 0.19.8's own MPI discovery assumes local ranks follow world-rank order, which Open MPI 5
does not guarantee on one host (it asserts, then hangs); dsnd reads each rank's own variables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dsnd.distributed.slurm import in_step, slurm_world
from dsnd.errors import UserError

DEFAULT_PORT = 29500
LOOPBACK = "127.0.0.1"
MPI_MARKERS = ("PMIX_RANK", "PMI_FD", "HYDI_CONTROL_FD", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "env", "openmpi", "mpich", "slurm", "mpi4py" or "single"
    all_local: bool = True  # every rank on this host (so loopback can rendezvous)
    # MASTER_ADDR:MASTER_PORT is a store torchrun's agent serves for the whole job, restarts
    # included (TORCHELASTIC_USE_AGENT_STORE=True): see `dsnd.distributed.elastic_store`
    agent_store: bool = False


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _mpi_world(env: Mapping[str, str], prefix: str) -> tuple[int, int, int, bool] | None:
    if prefix == "openmpi":
        keys = (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
    else:
        keys = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if keys[0] not in env or keys[1] not in env:
        return None
    rank, size = _int(env, keys[0]), _int(env, keys[1])
    local = _int(env, keys[2]) if keys[2] in env else 0
    local_size = _int(env, keys[3]) if keys[3] in env else None
    return rank, size, local, local_size == size


def _slurm(env: Mapping[str, str]) -> WorldInfo | None:
    found = slurm_world(env)
    return None if found is None else WorldInfo(*found[:5], "slurm", found[5])


def discover(env: Mapping[str, str]) -> WorldInfo | None:
    """The world described by `env`, or None when only mpi4py can tell (MPI without rank
    variables). A world of one when no launcher is present."""
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        addr = env.get("MASTER_ADDR", LOOPBACK)
        size = _int(env, "WORLD_SIZE")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torch writes str(True)
        return WorldInfo(_int(env, "RANK"), size, local, addr, port, "env", agent_store=agent)
    step = in_step(env)
    for source in ("openmpi", "mpich"):
        found = _mpi_world(env, source)
        if found:
            rank, size, local, all_local = found
            # `srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE but no local rank: Slurm's own variables
            # then tell the same world and the local rank. (A rank that mpirun started inside an
            # allocation inherits its daemon's SLURM_PROCID, which MPI's variables contradict.)
            slurm = _slurm(env) if source == "mpich" and step else None
            if slurm is not None and (slurm.rank, slurm.world_size) == (rank, size):
                return slurm
            addr = env.get("MASTER_ADDR") or (LOOPBACK if all_local else "")
            return WorldInfo(rank, size, local, addr, port, source, all_local)
    mpi = any(marker in env for marker in MPI_MARKERS)
    if step or not mpi:  # an MPI rank in a batch script is MPI's, not Slurm's
        slurm = _slurm(env)
        if slurm is not None:
            return slurm
    if mpi:
        return None
    return WorldInfo(0, 1, 0, env.get("MASTER_ADDR", LOOPBACK), port, "single")


JOB_ID_VARIABLES = ("DSND_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
"""Where a launcher says which job a rank belongs to: `dsnd launch` (one id for every attempt of
its restarts), torchrun (its rendezvous id, the same for restarted workers; "none" when the user
gave none) and Slurm (the same after a requeue)."""


def job_id(env: Mapping[str, str]) -> str | None:
    """The id of the job this process belongs to, or None when no launcher named one."""
    for name in JOB_ID_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != "none":
            return value
    return None
