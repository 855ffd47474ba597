"""What `dsnd train` (on every rank) and `dsnd launch` (once, before any rank) check before any
process group starts: one sequence, so a bad input or a bad checkpoint directory costs one line
and exit code 2 whichever way the job was started, and nothing already saved is touched.
"""

from __future__ import annotations

import logging
import os

from dsnd.checkpoint.files import check_root
from dsnd.checkpoint.resume import checkpoint_root, choose_resume, compare_with_checkpoint
from dsnd.checkpoint.root import check_writable
from dsnd.checkpoint.space import check_space
from dsnd.checkpoint.verify import read_manifest
from dsnd.config.resolve import Resolved
from dsnd.data.check import check_data
from dsnd.data.held_out import eval_data
from dsnd.errors import UserError
from dsnd.model.export_dir import ExportOrigin, check_target
from dsnd.model.hf_io import check_init_from

log = logging.getLogger(__name__)


def _check_data(res: Resolved) -> None:
    """data.path, and data.eval_path read the same way, against the model's vocabulary."""
    run = res.run
    check_data(run.data, res.model.vocab_size, run.model)
    if run.data.eval_path:
        try:
            check_data(eval_data(run), res.model.vocab_size, run.model)
        except UserError as e:  # the checks name the key they read the file from: data.path
            raise UserError(str(e).replace("data.path", "data.eval_path")) from e


def check_inputs(res: Resolved) -> None:
    """What a dry run checks too (it writes nothing): the data against the model's vocabulary,
    `model.init_from` against the model (names, shapes, config) and the export's target."""
    _check_data(res)
    if res.run.model.init_from:
        check_init_from(res.run.model.init_from, res.model)
    _check_export_target(res.run)


def _check_export_target(run) -> None:
    """`checkpoint.export_hf` is written after the last step: a directory it may not replace
    (`dsnd.model.export_dir`) is found now, not then."""
    path = run.checkpoint.export_hf
    if not path:
        return
    where = f"checkpoint.export_hf={path}"
    for other, key in ((run.log.dir, "log.dir"), (checkpoint_root(run), "checkpoint.dir")):
        mine, theirs = os.path.realpath(path), os.path.realpath(other)
        if os.path.commonpath([mine, theirs]) == mine:  # the same directory, or holding it
            raise UserError(
                f"{where}: holds {key} {other} (an export replaces its directory "
                "whole); name a directory of its own"
            )
    check_target(path, ExportOrigin(checkpoint_root(run), run.train.steps), where)


def check_before_start(res: Resolved, job_id: str | None) -> str | None:
    """Check the data, the directories a run writes to and the checkpoint it would resume (the
    layout was checked when the config resolved to its plan); returns that checkpoint's step
    directory (None: start fresh). Raises UserError."""
    run = res.run
    _check_data(res)
    root = checkpoint_root(run)
    check_root(root)
    check_writable(root, "checkpoint.dir")
    check_writable(run.log.dir, "log.dir")
    if run.checkpoint.export_hf:  # written after the last step: find out now, not then
        check_writable(run.checkpoint.export_hf, "checkpoint.export_hf", keep=False)
        _check_export_target(run)
    resume = choose_resume(run, job_id)
    if resume is not None:
        manifest = read_manifest(resume)
        own = job_id is not None and manifest.get("job_id") == job_id
        explicit = own or run.checkpoint.resume not in ("auto", "never")
        for line in compare_with_checkpoint(run, res.ds, res.model, manifest, resume, explicit):
            log.warning("resuming %s with a change: %s", os.path.basename(resume), line)
    elif run.model.init_from:  # a resume takes its weights from the checkpoint instead
        check_init_from(run.model.init_from, res.model)
    check_space(res, root, resume)  # a run that could not save even once
    return resume
