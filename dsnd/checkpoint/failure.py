"""A save that fails on any rank fails on every rank alike, and keeps the previous checkpoint.

A write the filesystem refuses (ENOSPC above all: a full disk; EDQUOT, EIO, ...) used to end
the rank that met it with a traceback, leave its peers to find a dead connection in their next
collective, and leave the unfinished `.tmp-step_N` beside the checkpoints until the next start.
Now every rank learns of it at the next point of a save where they meet anyway
(`agree`: one scalar all-reduce when nothing failed; the failures' text gathered only when
something did): rank 0 removes the temporary directory, `latest` stays on the previous
checkpoint, and every rank raises `WriteFailed` — exit 1 with one line on the rank whose write
failed, exit 4 ("a peer failed first") on the others, so that the launcher names the rank whose
disk filled (`dsnd.errors`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from dsnd.checkpoint.files import CheckpointError, latest
from dsnd.errors import EXIT_PEER_FAILED, WriteFailed

_T = TypeVar("_T")


def attempt(write: Callable[[], _T]) -> tuple[_T | None, OSError | None]:
    """(what `write` returned, None), or (None, the OSError it raised)."""
    try:
        return write(), None
    except OSError as e:
        return None, e


def said(error: OSError) -> str:
    """`error` in a few words: its reason and the file it names."""
    reason = error.strerror or str(error) or type(error).__name__
    return f"{reason} ({error.filename})" if error.filename else reason


def kept(root: str) -> str:
    """What stays of the checkpoints under `root` after a failed save."""
    try:
        pointed = latest(root)
    except CheckpointError:
        return "latest is unchanged"
    if pointed is None:
        return "no checkpoint was committed before it"
    return f"{os.path.basename(pointed)} stays latest"


def agree(error: OSError | None, root: str, tmp: str, name: str, device: torch.device) -> None:
    """Collective over the world: return when no rank's `error` is set; else rank 0 removes
    `tmp` (every rank is past its writes) and every rank raises `WriteFailed` naming the lowest
    rank that failed and why."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    texts: list = [None] * dist.get_world_size()
    dist.all_gather_object(texts, None if error is None else said(error))
    first = next(r for r, text in enumerate(texts) if text is not None)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    message = f"checkpoint {name} not saved: rank {first}: {texts[first]}; {kept(root)}"
    if error is None:
        raise WriteFailed(message, EXIT_PEER_FAILED)
    raise WriteFailed(message) from error
