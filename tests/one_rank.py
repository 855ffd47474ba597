"""A process group of this test process alone (gloo), for code that takes a group."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def one_rank_world(folder: str) -> Iterator[dist.ProcessGroup]:
    """The default group, of this process alone (its store a file in `folder`), torn down
    after the block."""
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        # DeepSpeed caches groups of the world it saw (a clone of WORLD for its broadcasts):
        # a later world in this process would meet them destroyed; its own teardown forgets them
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None:
            groups._release_process_group_references(group=None)
