"""Join the world: discover it, start the process group with a timeout, hand it to DeepSpeed."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings

import torch
import torch.distributed as dist

from dsnd.distributed.discover import LOOPBACK, WorldInfo, discover
from dsnd.distributed.elastic_store import process_group_store

log = logging.getLogger(__name__)


def _from_mpi4py(env: dict[str, str]) -> WorldInfo:
    """MPI without rank variables in the environment: ask MPI itself."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    all_local = local.Get_size() == comm.Get_size()
    # rank 0's host name (never an address from `hostname -I`) unless the user set one
    addr = env.get("MASTER_ADDR") or comm.bcast(
        LOOPBACK if all_local else socket.gethostname(), root=0
    )
    port = int(env.get("MASTER_PORT", "29500"))
    return WorldInfo(comm.Get_rank(), comm.Get_size(), local.Get_rank(), addr, port, "mpi4py",
                     all_local)  # fmt: skip


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def world_info(env: dict[str, str]) -> WorldInfo:
    """This process's world, asking MPI itself only where the environment cannot tell."""
    info = discover(env) or _from_mpi4py(env)
    if not info.master_addr:
        info = WorldInfo(info.rank, info.world_size, info.local_rank, _mpi_master(),
                         info.master_port, info.source, info.all_local)  # fmt: skip
    return info


def init_world(info: WorldInfo, timeout_s: float, backend: str = "auto") -> None:
    """Initialise torch.distributed (and DeepSpeed's comm layer) for this process.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT so DeepSpeed and any child
    code see one consistent world. The caller must call `shutdown()` on every exit path.
    """
    os.environ.update(
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )
    # DeepSpeed 0.19.8 calls torch.distributed names torch 2.13 deprecates, warning per call
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1:
        # no rendezvous needed (and no port to collide on) for a world of one
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    elif info.agent_store:  # torchrun's store outlives its restarts: one of this attempt's own
        store = process_group_store(info.master_addr, info.master_port, info.rank,
                                    info.world_size, timeout)  # fmt: skip
        dist.init_process_group(backend, store=store, rank=info.rank,
                                world_size=info.world_size, timeout=timeout)  # fmt: skip
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
    from dsnd.engine.compat import log_op_builds
    from dsnd.engine.public import init_distributed

    log_op_builds()  # before DeepSpeed's comm layer JIT-builds its shared-memory op
    init_distributed(backend, timeout)
    log.debug("joined world %s via %s", info, info.source)


def _mpi_master() -> str:
    """Multi-host MPI without MASTER_ADDR: rank 0's host name, broadcast over MPI."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def shutdown() -> None:
    """Destroy the process group if one exists (gloo ranks that skip this sometimes abort)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
