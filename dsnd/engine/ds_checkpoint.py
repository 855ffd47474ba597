"""DeepSpeed's own checkpoint files, read without running pickled code.

`to_universal` runs DeepSpeed's universal-checkpoint conversion
(`deepspeed.checkpoint.ds_to_universal`, as its command line would, in this one process) and
`load` reads one file; both load every file with `torch.load(weights_only=True)`: torch's own
switch `TORCH_FORCE_WEIGHTS_ONLY_LOAD` makes that hold for the converter's `torch.load` calls
too (it passes `weights_only=False` itself), and `SAFE_GLOBALS` are the only classes besides
tensors and plain containers allowed in a file. A file pickling anything else is refused by
torch with `pickle.UnpicklingError` naming the class (`refused_global` reads the name).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from collections.abc import Iterator

import torch
from deepspeed.checkpoint import (
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    ds_to_universal,
)
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

# What DeepSpeed 0.19.8's checkpoints pickle besides tensors and plain containers (the files
# of ZeRO-1 (PipelineEngine, pp=2) and ZeRO-3 engines load with these alone in
# `tests/distributed/test_ckpt_import.py`; ZeRO-2's, not in the suite, hold the same): the
# optimizer files' loss-scaler state (fp32 training saves a static `LossScaler`), the ZeRO
# stage (an enum) and, at ZeRO-1/2, each parameter's slice of the flat partition
# (`fragment_address`). Model-state and pipeline layer files hold tensors, dicts, `torch.Size`
# and strings only.
SAFE_GLOBALS = (LossScaler, ZeroStageEnum, fragment_address)
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both set: unset it meanwhile


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """Every `torch.load` inside loads with weights_only=True, allowing `SAFE_GLOBALS`."""
    saved = {name: os.environ.get(name) for name in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NOT, None)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load(path: str):
    """One DeepSpeed checkpoint file, on the CPU, weights only."""
    with weights_only():
        return torch.load(path, map_location="cpu", weights_only=True)


def refused_global(error: BaseException) -> str | None:
    """The class a weights-only load refused ('module.Name'), or None for another error."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return found.group(1) if found else None


# A PipelineModule's tied module (`tied_modules.<key>.*`) is held by every stage that uses it,
# but only the first stage's copy is the model's: DeepSpeed keeps the tied attribute (the
# embedding matrix) equal on all of them, while the rest of the module (GPT-2's position
# embedding, which the head does not use) never trains on later stages. The converter skips
# later stages' copies of parameters matching these patterns; without them the last stage's
# copy overwrites the first's (observed, not in the suite: gpt2-tiny at pp=2 imported its
# untrained position embedding, continued losses 1e-4 off).
TIED_PATTERNS = [r"tied_modules\."]


def _inject_missing_state(ds_checkpoint) -> None:
    """What the converter's `--inject_missing_state` adds to a checkpoint saved without
    `universal_checkpoint_info`, and the tied-module pattern (`TIED_PATTERNS`)."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PIPELINE_REPLICATED_PARAMETER_PATTERNS: TIED_PATTERNS,
        }


@contextlib.contextmanager
def _injecting() -> Iterator[None]:
    """The converter's `_inject_missing_state` is `_inject_missing_state` above meanwhile (its
    `main` offers no other way to give the patterns)."""
    original = ds_to_universal._inject_missing_state
    ds_to_universal._inject_missing_state = _inject_missing_state
    try:
        yield
    finally:
        ds_to_universal._inject_missing_state = original


def to_universal(tag_dir: str, out_dir: str) -> str:
    """Convert the DeepSpeed checkpoint `tag_dir` (one tag: ZeRO 1-3, pipeline or not) into a
    universal checkpoint in `out_dir` (created; its parent gets DeepSpeed's `latest_universal`
    file): `zero/<parameter name>/{fp32,exp_avg,exp_avg_sq}.pt` full tensors, `step.pt` at
    ZeRO-1/2, and `zero/optimizer_state.pt` (param groups, ZeRO stage). Returns what the
    converter printed. A checkpoint written without `universal_checkpoint_info` (any engine but
    Megatron-DeepSpeed's) gets the minimal one, as the converter's `--inject_missing_state`
    does, with `TIED_PATTERNS`. One worker each: no process pool."""
    args = argparse.Namespace(
        input_folder=tag_dir,
        output_folder=out_dir,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    said = io.StringIO()
    with (
        weights_only(),
        _injecting(),
        contextlib.redirect_stdout(said),
        contextlib.redirect_stderr(said),
    ):
        ds_to_universal.main(args)
    return said.getvalue()
