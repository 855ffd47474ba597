"""Which checkpoint a run starts from (`checkpoint.resume` and the job id), decided before any
rank starts, and whether that checkpoint belongs to this run.

A job restarted after a failure (by `dsnd launch --max-restarts`, torchrun or a Slurm requeue)
keeps its job id; its newest committed checkpoint is then the only right place to continue from,
whatever `checkpoint.resume` says: `auto` would also do, but a path would start the fine-tune
over and `never` would start from random weights, losing the job's own progress. Checkpoints
written by other jobs are taken only as `checkpoint.resume` allows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from dsnd.checkpoint.files import CheckpointError, committed, resolve_step_dir
from dsnd.checkpoint.verify import check_intact, newest_intact, read_manifest, verify
from dsnd.config.schema import RunConfig
from dsnd.model.source import ModelSpec, from_manifest

log = logging.getLogger(__name__)


def checkpoint_root(run: RunConfig) -> str:
    """`checkpoint.dir`, or `<log.dir>/checkpoints` when it is null."""
    return run.checkpoint.dir or os.path.join(run.log.dir, "checkpoints")


def newest_of_job(root: str, job_id: str, warn: Callable[[str], None]) -> str | None:
    """The newest committed, intact checkpoint under `root` that job `job_id` wrote."""
    for step_dir in committed(root):
        try:
            if read_manifest(step_dir).get("job_id") != job_id:
                continue
        except CheckpointError:
            continue  # a damaged manifest: `verify` below would say the same
        problems = verify(step_dir)
        if not problems:
            return step_dir
        warn(f"skipping checkpoint {step_dir}: {problems[0]}")
    return None


def choose_resume(run: RunConfig, job_id: str | None = None) -> str | None:
    """The step directory to resume from, or None to start fresh.

    First the newest intact checkpoint this job (`job_id`) committed, if any. Otherwise
    `checkpoint.resume`: auto: the newest committed checkpoint under the root that verifies
    (corrupt ones are skipped with a warning); never: none; anything else is a path (a root,
    meaning its `latest`, or a step directory) that must verify, else CheckpointError (exit 2)
    naming the file.
    """
    if job_id is not None:
        own = newest_of_job(checkpoint_root(run), job_id, log.warning)
        if own is not None:
            log.info("job %s resumes its own newest checkpoint %s", job_id, own)
            return own
    mode = run.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return newest_intact(checkpoint_root(run), log.warning)
    step_dir = resolve_step_dir(mode)
    check_intact(step_dir)
    return step_dir


# What a resumed run must share with the checkpoint's run, and what it may change. The layout
# (parallel.*, ZeRO stage, micro-batch and accumulation) may change: checkpoints are layout-free.
MUST_MATCH_ALWAYS = ("model",)  # the architecture: the tensors would not even fit
MUST_MATCH_IMPLICITLY = (
    "train.seed",
    "data.path",
    "data.blend",
    "data.format",
    "data.text_field",
    "data.max_bytes",
)
# eval.fraction and data.eval_path decide which samples train (dsnd.data.held_out);
# model.moe_capacity_factor which tokens reach their experts (dropless <-> capped, or another
# cap: the weights fit either way, so it is allowed, and said)
WARN_RUN = (
    "model.seq_len",
    "train.lr_scaling",
    "train.lr_reference_batch",
    "eval.fraction",
    "data.eval_path",
    "model.moe_capacity_factor",
)
WARN_DS = ("train_batch_size", "optimizer", "scheduler", "gradient_clipping", "bf16", "bfloat16")


def _dotted(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _differences(keys: tuple[str, ...], now: dict, then: dict) -> list[str]:
    """Each changed key as `key old -> new`; a section by its changed keys, so that the note
    says which hyper-parameter changed (`ds.optimizer.params.betas [0.9, 0.95] -> [0.9, 0.99]`),
    each of them applied by the resumed run."""
    out = []
    for key in keys:
        old, new = _dotted(then, key), _dotted(now, key)
        if isinstance(old, dict) and isinstance(new, dict):
            inner = tuple(f"{key}.{k}" for k in dict.fromkeys([*old, *new]))
            out += _differences(inner, now, then)
        elif old != new:
            out.append(f"{key} {old!r} -> {new!r}")
    return out


SAME_STATE = {"adam": "adam", "adamw": "adam"}
"""Optimizer types (lower case) whose saved state another type of the same value reads as its
own: Adam and AdamW keep exp_avg and exp_avg_sq alike (AdamW differs only in the decay)."""


def _check_same_optimizer(then_ds: dict, ds: dict, manifest: dict, step_dir: str) -> None:
    """Refuse continuing a checkpoint's optimizer state with another kind of optimizer: the
    state would be read as something it is not (SGD's momentum as Adam's first moment)."""
    then, now = _dotted(then_ds, "optimizer.type"), _dotted(ds, "optimizer.type")
    if not isinstance(then, str) or not isinstance(now, str):
        return
    if SAME_STATE.get(then.lower(), then.lower()) != SAME_STATE.get(now.lower(), now.lower()):
        keys = ", ".join(manifest.get("optim_keys") or []) or "none"
        raise CheckpointError(
            f"{step_dir}: written with optimizer {then} (state: {keys}); this "
            f"run's is {now}, which cannot continue that state: use {then}, "
            "or start fresh with checkpoint.resume=never or another "
            "checkpoint.dir"
        )


def compare_with_checkpoint(
    run: RunConfig, ds: dict, model: ModelSpec, manifest: dict, step_dir: str, explicit: bool
) -> list[str]:
    """Refuse (CheckpointError) a resume that would be meaningless; return warnings for the rest.

    The model's shape must always match. The seed and the data must match when the checkpoint
    was found rather than named (`auto`: most likely another run's directory); a checkpoint
    named by path may be continued on other data or another seed, with a warning.
    """
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    then_run, then_ds = config.get("run") or {}, config.get("deepspeed") or {}
    now_run = dataclasses.asdict(run)
    now, then = model.math(), from_manifest(manifest["model"]).math()
    changed = [
        f"{k} {then.get(k)!r} -> {now.get(k)!r}"
        for k in sorted(set(now) | set(then))
        if now.get(k) != then.get(k)
    ]
    if changed:
        raise CheckpointError(
            f"{step_dir}: written for another model ({', '.join(changed)}); "
            "resume it with the same model, or start fresh with "
            "checkpoint.resume=never or another checkpoint.dir"
        )
    _check_same_optimizer(then_ds, ds, manifest, step_dir)
    strict = _differences(MUST_MATCH_IMPLICITLY, now_run, then_run)
    if strict and not explicit:
        raise CheckpointError(
            f"{step_dir}: written by a run with other settings ({', '.join(strict)}); name it "
            "in checkpoint.resume to continue from it anyway, or start fresh with "
            "checkpoint.resume=never or another checkpoint.dir"
        )
    warn = strict + _differences(WARN_RUN, now_run, then_run)
    warn += [f"ds.{d}" for d in _differences(WARN_DS, ds, then_ds)]
    return warn
