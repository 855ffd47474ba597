"""Room for a checkpoint, checked before start: a run that cannot save even once is refused.

With ``checkpoint.every: 0`` the only save is at the end, so a checkpoint directory without
room for one checkpoint would lose the whole run's work there. A save writes the new
checkpoint whole before `checkpoint.keep` removes the oldest (`dsnd.checkpoint.commit`), so
whatever is kept, a save needs room for one more checkpoint than the directory holds.

A checkpoint's size: the files of the checkpoint the run resumes from (its manifest records
their bytes), else an estimate from the model and the optimizer — every parameter once as its
full fp32 value plus the optimizer's fp32 state per parameter (Adam: two moments, 12 bytes per
parameter in all; `dsnd.engine.optimizers.state_bytes`), within a few percent of what a save
writes (safetensors headers, RNG files and the manifest are the rest). A save that still runs
out of room fails in one line and keeps the previous checkpoint (`dsnd.checkpoint.save`).
"""

from __future__ import annotations

import os
import shutil

from dsnd.checkpoint.verify import read_manifest
from dsnd.config.resolve import Resolved
from dsnd.engine.optimizers import state_bytes
from dsnd.errors import UserError
from dsnd.model.count import layer_table

MIB = 1 << 20


def saves(run) -> bool:
    """Whether the run saves on its own (a stop request saves whatever this says)."""
    every = run.checkpoint.every
    return run.checkpoint.at_end or 0 < every <= run.train.steps


def estimate_bytes(res: Resolved) -> int:
    """What a checkpoint of `res`'s model and optimizer takes (module docstring)."""
    zero = res.ds.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    try:
        _, per_param = state_bytes(res.ds["optimizer"], res.plan.zero_stage > 0 and offload)
    except (KeyError, ValueError, TypeError):  # no optimizer section to ask: Adam's
        per_param = 8
    params = sum(n for _, _, n in layer_table(res.model))
    return params * (4 + per_param)


def checkpoint_bytes(res: Resolved, resume: str | None) -> int:
    """The bytes one more checkpoint takes: `resume`'s files, else `estimate_bytes`."""
    if resume is not None:
        files = read_manifest(resume).get("files")
        if isinstance(files, dict) and files:
            return sum(int(f.get("bytes", 0)) for f in files.values() if isinstance(f, dict))
    return estimate_bytes(res)


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the filesystem that holds `path` or would hold it."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_space(res: Resolved, root: str, resume: str | None) -> None:
    """UserError unless the filesystem of `root` has room for one more checkpoint."""
    if not saves(res.run):
        return
    need, free = checkpoint_bytes(res, resume), free_bytes(root)
    if free >= need:
        return
    every, keep = res.run.checkpoint.every, res.run.checkpoint.keep
    which = (
        "the only one, at the end: checkpoint.every=0, so the whole run's work"
        if not every
        else f"checkpoint.every={every}: the work since the last one"
    )
    rotation = (
        (f"; checkpoint.keep={keep} removes the oldest only after a new one is written")
        if keep
        else ""
    )
    source = f"the manifest of {resume}" if resume else "the model and optimizer"
    raise UserError(
        f"checkpoint.dir {root}: {free / MIB:.1f} MiB free, but a checkpoint of "
        f"this run takes about {need / MIB:.1f} MiB ({source}): a save would fail "
        f"({which} lost){rotation}; free space there or set checkpoint.dir to a "
        "larger filesystem"
    )
