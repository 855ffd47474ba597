"""DeepSpeed's public API as the rest of dsnd calls it, so that no module outside this package
imports DeepSpeed (each call imports it when first made: importing dsnd's plan, config or
topology never does).

- `gathered_parameters`: ZeRO-3's `deepspeed.zero.GatheredParameters` (a no-op below ZeRO-3),
  for reading or writing whole parameters (exports, tied weights).
- `zero_init`: `deepspeed.zero.Init(module=...)`, partitioning a built layer over a group.
- `distributed_attention`: DeepSpeed's Ulysses `DistributedAttention` (all-to-all over heads).
- `init_distributed`: `deepspeed.init_distributed` on a process group that is already up.
- `comms_log_summary`: `deepspeed.comm.log_summary`, the comms_logger's table.
- `accelerator`, `version`: `deepspeed.accelerator.get_accelerator()`, `deepspeed.__version__`;
  `accelerator_device`: its current device, as a `torch.device`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


def gathered_parameters(params: Sequence[Any], modifier_rank: int | None = None) -> Any:
    """A context in which ZeRO-3-partitioned `params` are whole (written back from
    `modifier_rank`, when given, on exit)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank)


def zero_init(module: Any, **kwargs: Any) -> Any:
    """ZeRO-3-partition the parameters of a built `module`; `kwargs` as `deepspeed.zero.Init`."""
    import deepspeed

    return deepspeed.zero.Init(module=module, **kwargs)


def distributed_attention(
    local: Callable[..., Any], group: Any, scatter_idx: int, gather_idx: int
) -> Any:
    from deepspeed.sequence.layer import DistributedAttention

    return DistributedAttention(local, group, scatter_idx=scatter_idx, gather_idx=gather_idx)


def init_distributed(backend: str, timeout: timedelta) -> None:
    """DeepSpeed's comm layer on the default process group (already initialised by dsnd, so
    DeepSpeed discovers nothing itself)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)


def comms_log_summary() -> dict[str, Any] | None:
    """The comms_logger's summary (collective: every rank calls it); rank 0 prints its table."""
    import deepspeed.comm

    return deepspeed.comm.log_summary(return_dict=True)


def accelerator() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def accelerator_device() -> Any:
    """This rank's accelerator device (`torch.device`), where DeepSpeed puts the engine and
    where every tensor that meets a collective must live (NCCL takes device tensors only)."""
    import torch

    return torch.device(accelerator().current_device_name())


def version() -> str:
    import deepspeed

    return deepspeed.__version__
