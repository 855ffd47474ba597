"""Which checkpoint a run starts from (`checkpoint.resume`), decided before any rank starts."""

from __future__ import annotations

import logging
import os

from dsnd.checkpoint.layout import check_intact, newest_intact, resolve_step_dir
from dsnd.config.schema import RunConfig

log = logging.getLogger(__name__)


def checkpoint_root(run: RunConfig) -> str:
    """`checkpoint.dir`, or `<log.dir>/checkpoints` when it is null."""
    return run.checkpoint.dir or os.path.join(run.log.dir, "checkpoints")


def choose_resume(run: RunConfig) -> str | None:
    """The step directory to resume from, or None to start fresh.

    auto: the newest committed checkpoint under the root that verifies (corrupt ones are skipped
    with a warning); never: none; anything else is a path (a root, meaning its `latest`, or a step
    directory) that must verify, else CheckpointError (exit 2) naming the file.
    """
    mode = run.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return newest_intact(checkpoint_root(run), log.warning)
    step_dir = resolve_step_dir(mode)
    check_intact(step_dir)
    return step_dir
