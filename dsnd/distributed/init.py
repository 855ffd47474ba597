"""Join the world: discover it, start the process group with a timeout, hand it to DeepSpeed.

With NCCL each rank binds one GPU before the process group starts (`cuda_device_index`) and
hands it to `init_process_group` as `device_id`: NCCL's communicator is then created eagerly on
that device, not lazily on whatever device is current at the first collective. The NCCL
watchdog aborts a rank whose collective timed out (SIGABRT, past any Python handler); torch's
flight recorder is switched on so that such a rank leaves its last collectives behind
(`flight_recorder_env`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist

from dsnd.distributed.discover import LOOPBACK, WorldInfo, discover
from dsnd.distributed.elastic_store import process_group_store
from dsnd.errors import UserError

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
    return WorldInfo(
        comm.Get_rank(), comm.Get_size(), local.Get_rank(), addr, port, "mpi4py", all_local
    )


def backend_for(backend: str, ds_accelerator: str | None, cuda_available: bool) -> str:
    """The process-group backend for `dist.backend` under DeepSpeed's accelerator
    `ds_accelerator` (DS_ACCELERATOR; None: DeepSpeed detects it, CUDA where torch sees a GPU).

    `auto` is the accelerator's backend, not the machine's: DS_ACCELERATOR=cpu keeps every tensor
    on the CPU, where NCCL has no kernels ("No backend type associated with device type cpu"),
    so such ranks use gloo even on a GPU machine. dsnd's own CPU ranks (`dsnd bench`, the tests,
    `dsnd plan --validate`: `dsnd.launcher.local_ranks`) run that way, 2-4 of them per machine,
    which NCCL would refuse on one GPU anyway. `nccl` under the CPU accelerator is refused.
    """
    if backend == "nccl" and ds_accelerator == "cpu":
        raise UserError(
            "dist.backend=nccl needs DeepSpeed's CUDA accelerator, but DS_ACCELERATOR="
            "cpu (NCCL has no CPU tensors); use dist.backend auto or gloo"
        )
    if backend != "auto":
        return backend
    if ds_accelerator == "cpu":
        return "gloo"
    return "nccl" if cuda_available else "gloo"


def resolve_backend(backend: str) -> str:
    """`backend_for` this process: its DS_ACCELERATOR and whether torch sees a GPU."""
    return backend_for(backend, os.environ.get("DS_ACCELERATOR"), torch.cuda.is_available())


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The GPU (an index among the `device_count` this process sees) an NCCL rank binds to.

    The local rank, modulo the devices seen: a launcher that shows each rank all of its host's
    GPUs (DeepSpeed's, dsnd's agent: CUDA_VISIBLE_DEVICES = the host's selected slots) gives
    rank i device i; one that binds a GPU per task (Slurm's --gpus-per-task=1) shows each rank
    one device, index 0, whatever its local rank. Two ranks on one GPU are NCCL's to refuse.
    """
    if device_count < 1:
        raise UserError(
            f"dist.backend=nccl: local rank {local_rank} sees no CUDA device "
            "(CUDA_VISIBLE_DEVICES empty, or no GPU on this host)"
        )
    return local_rank % device_count


TRACE_ENTRIES = 2000
"""Collectives torch's flight recorder keeps per rank (its ring buffer; 0, torch's default, is
off): enough to see which collective a timed-out rank and its peers were in."""


def flight_recorder_env(environ: Mapping[str, str], log_dir: str | None) -> dict[str, str]:
    """The variables an NCCL rank adds to its environment before its process group starts, each
    only where the user set neither it nor its newer name (torch 2.13 reads both): the flight
    recorder's buffer, its dump when the watchdog times a collective out, and the dump's files
    in `<log_dir>/logs/nccl_trace_rank_<rank>` when the run has a log directory (torch's
    default is /tmp)."""
    out = {}
    if not {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"} & set(environ):
        out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(TRACE_ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    named = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"} & set(environ)
    if log_dir and not named:
        out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(log_dir, "logs", "nccl_trace_rank_")
    return out


def _bind_gpu(local_rank: int, log_dir: str | None) -> torch.device:
    """NCCL only: the flight recorder's variables, then this rank's GPU made current."""
    log_dir = os.path.abspath(log_dir) if log_dir else None
    if log_dir:
        os.makedirs(os.path.join(log_dir, "logs"), exist_ok=True)
    os.environ.update(flight_recorder_env(os.environ, log_dir))
    device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def world_info(env: dict[str, str]) -> WorldInfo:
    """This process's world, asking MPI itself only where the environment cannot tell."""
    info = discover(env) or _from_mpi4py(env)
    if not info.master_addr:
        info = WorldInfo(
            info.rank,
            info.world_size,
            info.local_rank,
            _mpi_master(),
            info.master_port,
            info.source,
            info.all_local,
        )
    return info


def init_world(
    info: WorldInfo, timeout_s: float, backend: str = "auto", log_dir: str | None = None
) -> None:
    """Initialise torch.distributed (and DeepSpeed's comm layer) for this process.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT so DeepSpeed and any child
    code see one consistent world. With NCCL, binds the rank's GPU first and keeps the flight
    recorder's dumps in `log_dir` (see the module docstring). The caller must call `shutdown()`
    on every exit path.
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
    device = _bind_gpu(info.local_rank, log_dir) if backend == "nccl" else None
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1:
        # no rendezvous needed (and no port to collide on) for a world of one
        store = dist.HashStore()
        dist.init_process_group(
            backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device
        )
    elif info.agent_store:  # torchrun's store outlives its restarts: one of this attempt's own
        store = process_group_store(
            info.master_addr, info.master_port, info.rank, info.world_size, timeout
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device,
        )
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device,
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
