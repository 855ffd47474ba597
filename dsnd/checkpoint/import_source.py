"""The DeepSpeed checkpoint `dsnd ckpt import` (`dsnd.checkpoint.import_ds`) reads: its tag
directory found, its model-state files read (weights only) and checked for what dsnd can import,
each refusal one line naming the DeepSpeed file and key."""

from __future__ import annotations

import glob
import os
import pickle
import re
from dataclasses import dataclass

from dsnd.checkpoint.ds_names import Shapes, naming
from dsnd.checkpoint.schema import COUNT, STEP, Rule, value_problem
from dsnd.engine import ds_checkpoint
from dsnd.errors import UserError

_LAYER_FILE = re.compile(r"layer_\d+-model_.*")  # a pipeline layer's weights (not the masters)


@dataclass
class Source:
    """One tag of a DeepSpeed checkpoint, as read before converting it."""

    tag_dir: str
    model_files: list[str]  # *_model_states.pt: one per pipeline stage, or per rank at ZeRO-3
    state: dict  # the first model-state file (steps, LR scheduler, config), without weights
    shapes: Shapes  # every trained parameter's full shape, by DeepSpeed name
    stage_names: list[list[str]]  # the names each model-state file lists (pipeline stages)

    @property
    def pipeline(self) -> bool:
        return naming(list(self.shapes)) == "pipeline"


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def _model_files(tag_dir: str) -> list[str]:
    found = glob.glob(os.path.join(tag_dir, "*_model_states.pt"))
    return sorted(
        (
            f
            for f in found
            if not _LAYER_FILE.fullmatch(os.path.basename(f))
            and "_expert_" not in os.path.basename(f)
        ),
        key=_natural,
    )


def find_tag(path: str) -> str:
    """The tag directory `path` means: itself when it holds model-state files, else the tag its
    `latest` file names (as DeepSpeed's `load_checkpoint` reads it)."""
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such directory")
    if _model_files(path):
        return path
    pointer = os.path.join(path, "latest")
    if not os.path.isfile(pointer):
        raise UserError(
            f"{path}: not a DeepSpeed checkpoint (no *_model_states.pt, and no "
            "'latest' naming a tag directory)"
        )
    with open(pointer, encoding="utf-8", errors="replace") as f:
        tag = f.read().strip()
    tag_dir = os.path.join(path, tag)
    if not tag or os.sep in tag or tag in (".", "..") or not _model_files(tag_dir):
        raise UserError(
            f"{pointer}: names {tag!r}, which is not a tag directory holding *_model_states.pt"
        )
    return tag_dir


def load_file(path: str):
    """One DeepSpeed file, weights only; a refusal or a damaged file is one line."""
    try:
        return ds_checkpoint.load(path)
    except pickle.UnpicklingError as e:
        raise UserError(refusal(path, e)) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise UserError(f"{path}: not readable by torch.load ({first_line(e)})") from None


def refusal(path: str, error: BaseException) -> str:
    cls = ds_checkpoint.refused_global(error)
    if cls is None:
        return f"{path}: refused by torch.load(weights_only=True) ({first_line(error)})"
    allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in ds_checkpoint.SAFE_GLOBALS)
    return (
        f"{path}: holds a pickled {cls}; dsnd loads DeepSpeed checkpoints with "
        f"torch.load(weights_only=True), allowing only tensors and {allowed}"
    )


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _shapes_of(state: dict, path: str) -> dict[str, tuple[int, ...]]:
    groups = state.get("param_shapes") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UserError(
            f"{path}: no 'param_shapes' list (not written by DeepSpeed's "
            "save_checkpoint with a ZeRO optimizer)"
        )
    return {name: tuple(int(d) for d in size) for g in groups for name, size in g.items()}


def read_source(path: str) -> Source:
    """The tag `path` means, checked for what dsnd can import (one line if not)."""
    tag_dir = find_tag(path)
    if not glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
        raise UserError(
            f"{tag_dir}: no ZeRO optimizer files (*_optim_states.pt): saved without "
            "ZeRO; DeepSpeed's universal-checkpoint conversion needs ZeRO stage 1, "
            "2 or 3"
        )
    files = _model_files(tag_dir)
    shapes: Shapes = {}
    stage_names, first = [], {}
    for i, file in enumerate(files):
        state = load_file(file)
        found = _shapes_of(state, file)
        shapes |= found
        stage_names.append(list(found))
        if i == 0:
            first = {k: v for k, v in state.items() if k != "module"}
        del state
    dims = first.get("checkpoint_parallel_dimensions") or {}
    tp = dims.get("tp_degree", 1) if isinstance(dims, dict) else 1
    if tp != 1:
        raise UserError(
            f"{tag_dir}: saved with tensor parallelism (tp_degree {tp}); dsnd imports "
            "DeepSpeed checkpoints without it (its tensor parallelism is Megatron's, "
            "resumed from any layout once imported)"
        )
    frozen = first.get("frozen_param_shapes") or {}
    if frozen:
        name = next(iter(frozen))
        raise UserError(
            f"{files[0]}: holds {len(frozen)} frozen parameter(s) ({name}, ...); "
            "dsnd trains every parameter (it has no Adam state for these)"
        )
    if first.get("global_steps") is None:
        raise UserError(
            f"{files[0]}: no 'global_steps' (not written by DeepSpeed's save_checkpoint)"
        )
    for key, rule in _STATE_NUMBERS.items():
        refuse_number(files[0], key, first.get(key), rule)
    return Source(tag_dir, files, first, shapes, stage_names)


# the model-state file's numbers the manifest takes as they are, with the manifest's own rules
# (global_samples may be absent: the samples are then counted from the batch size)
_STATE_NUMBERS: dict[str, Rule] = {
    "global_steps": STEP,
    "global_samples": ("null or " + COUNT[0], lambda v: v is None or COUNT[1](v)),
}


def refuse_number(where: str, key: str, value: object, rule: Rule) -> None:
    """UserError "<where>: '<key>' is <value>, expected <rule>" unless `value` keeps `rule`:
    checked on the DeepSpeed file itself, so the refusal names the file and the key a user can
    look at (not the manifest dsnd would have written from them)."""
    what = value_problem(value, rule)
    if what:
        raise UserError(f"{where}: '{key}' {what}")
