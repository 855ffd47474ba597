"""What every rank program of these tests (the ``*_worker.py`` files and ``train_cases.py``,
started on gloo ranks by `tests.procs.run_ranks`) does around its own checks, written once.

A rank program takes its world from the launcher's environment with one thread (`this_rank`),
does what it must before the process group exists (resolving runs, so that DeepSpeed's checks
see them), holds the process group for its checks only (`world`: shut down even when a check
fails, as gloo ranks that skip it sometimes abort), collects every rank's findings (`everyone`)
and leaves them in one JSON file for the test (`write_json`).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dsnd.distributed.init import WorldInfo, init_world, shutdown, world_info
from tests.nccl_rules import record


def this_rank() -> WorldInfo:
    """One thread, as every dsnd rank runs here; this rank's place in the launcher's world."""
    torch.set_num_threads(1)
    return world_info(dict(os.environ))


@contextmanager
def world(info: WorldInfo, timeout_s: int, plain: bool = False) -> Iterator[None]:
    """The process group for the block, destroyed after it whatever happened: dsnd's own
    (`init_world`), or with `plain` only torch's gloo group (no DeepSpeed, whose import costs
    seconds, for checks that do not need it). With ``DSND_NCCL_TRACE`` set, every
    communication call of the block is recorded there (`tests.nccl_rules.record`)."""
    recorder = record.start(info.rank)
    if plain:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    else:
        init_world(info, timeout_s=timeout_s)
    try:
        yield
    finally:
        shutdown()
        record.finish(recorder)


def everyone(mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order, on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def write_json(path: str, data: Any, rank: int, writer: int = 0) -> None:
    """`data` as JSON at `path`, by rank `writer` alone (the others return)."""
    if rank == writer:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
