"""A checkpoint DeepSpeed's own engine saved -> a dsnd checkpoint (`dsnd ckpt import`).

Input: what `engine.save_checkpoint(DIR)` wrote, ZeRO stage 1, 2 or 3 — a `PipelineEngine`'s
(`layer_XX-model_states.pt` per layer, ZeRO-1 partitions per stage) or a plain
`DeepSpeedEngine`'s — as DIR (its `latest` names the tag) or one tag directory.

1. Checked before anything is written: the model-state files (read by `import_source` with
   `torch.load(weights_only=True)`, `dsnd.engine.ds_checkpoint`) name every trained parameter
   with its full shape; each must map to the run config's model and the model must be complete
   (`ds_names`); no tensor parallelism, no frozen parameters, ZeRO optimizer files present;
   the step, samples and LR-scheduler position a resume takes as they are within the ranges a
   dsnd manifest allows (`dsnd.checkpoint.schema`: a step beyond what a step directory's name
   holds is refused here, not by the resume), each refusal naming the DeepSpeed file and key;
   OUT must not exist (or be an empty directory).
2. DeepSpeed's universal-checkpoint conversion (`ds_to_universal`) joins every parameter's fp32
   master and Adam moments over the data-parallel partitions and pipeline stages, into a
   temporary directory beside OUT (removed at the end, whatever happens). The learning rate
   and betas it took from data-parallel rank 0's optimizer file are checked the same way; a
   NaN or infinity in what it joined, or a step count that is not an integer, is refused
   naming the optimizer file and key it came from (`import_blame`), not the temporary files.
3. dsnd writes per-layer safetensors files (fp32 master as the weight, exp_avg and exp_avg_sq),
   the trainer state (step, Adam's step, learning rate, betas, DeepSpeed's LR-scheduler state)
   and a manifest, and commits them as OUT/step_<step> with OUT/latest
   (`dsnd.checkpoint.commit`), then verifies the result as `dsnd ckpt verify` does.

The universal files are read here directly: they are the converter's output (a tensor, or a
dict with it under "param"), and DeepSpeed's own reader of them loads into a live ZeRO engine.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile

import torch
from safetensors.torch import save as safetensors_bytes

from dsnd.checkpoint.commit import publish, temporary_dir, write_atomic, write_manifest
from dsnd.checkpoint.ds_names import dsnd_names, layer_indices, naming
from dsnd.checkpoint.files import FORMAT, model_file, optim_file, step_dir_name
from dsnd.checkpoint.import_blame import check_finite, checked_step
from dsnd.checkpoint.import_source import (
    Source,
    first_line,
    load_file,
    read_source,
    refusal,
    refuse_number,
)
from dsnd.checkpoint.save import software_versions
from dsnd.checkpoint.schema import BETAS, LR, POSITION
from dsnd.checkpoint.verify import check_intact
from dsnd.config.schema import RunConfig
from dsnd.config.strict import as_data
from dsnd.engine import ds_checkpoint
from dsnd.errors import UserError
from dsnd.model.source import ModelSpec
from dsnd.secrets import mask_config

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
# what the converter's errors are (its checks are asserts; a broken file is any of the others)
_CONVERSION_ERRORS = (
    AssertionError,
    KeyError,
    IndexError,
    ValueError,
    TypeError,
    RuntimeError,
    OSError,
    EOFError,
    NotImplementedError,
    pickle.UnpicklingError,
)


def check_out(out: str) -> str:
    """The directory OUT will be made in; UserError unless OUT is new (or an empty directory)
    and that directory is writable."""
    if os.path.lexists(out) and (not os.path.isdir(out) or os.path.islink(out) or os.listdir(out)):
        raise UserError(
            f"{out}: already exists and is not an empty directory (dsnd never writes "
            "over a checkpoint; name a new OUT)"
        )
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{out}: cannot be created ({parent} is not a writable directory)")
    return parent


def _scheduler_state(state: dict, where: str) -> dict | None:
    sched = state.get("lr_scheduler")
    if sched is None:
        return None
    try:
        json.dumps(sched, allow_nan=False)
    except (TypeError, ValueError):
        raise UserError(
            f"{where}: the LR scheduler's state is not plain data (only DeepSpeed's "
            "schedulers, from the JSON's 'scheduler' section, can be continued)"
        ) from None
    if not isinstance(sched, dict) or "last_batch_iteration" not in sched:
        keys = (
            ", ".join(sorted(map(str, sched))) if isinstance(sched, dict) else type(sched).__name__
        )
        raise UserError(
            f"{where}: the LR scheduler's state ({keys}) is not one of DeepSpeed's "
            "schedulers (those of the JSON's 'scheduler' section, which dsnd "
            "continues)"
        )
    refuse_number(
        where, "lr_scheduler.last_batch_iteration", sched["last_batch_iteration"], POSITION
    )
    return sched


def _tensor(
    universal: str, name: str, key: str, shape: tuple[int, ...], tag_dir: str
) -> torch.Tensor:
    """One full tensor the converter wrote for parameter `name`, in `shape`, fp32 and finite
    (else refused naming the optimizer file and key of `tag_dir` it came from)."""
    path = os.path.join(universal, "zero", name, f"{key}.pt")
    if not os.path.isfile(path):
        raise UserError(
            f"{name}: DeepSpeed's conversion wrote no {key} for it (no optimizer "
            "state: was it ever trained?)"
        )
    value = load_file(path)
    value = value.get("param") if isinstance(value, dict) else value
    if not torch.is_tensor(value) or value.numel() != torch.Size(shape).numel():
        got = list(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise UserError(f"{name}: DeepSpeed's conversion wrote {key} {got}, expected {list(shape)}")
    value = value.reshape(shape).to(torch.float32).contiguous()
    check_finite(value, tag_dir, name, key)
    return value


def _adam_step(universal: str, names: list[str], optim: dict, tag_dir: str) -> int:
    """Adam's step count: each parameter's step.pt (ZeRO-1/2), else the optimizer's state or
    its param group (ZeRO-3, optimizers that count per group); all must agree, each an integer
    (`checked_step`: a string "3" is refused naming its file and key in `tag_dir`)."""
    found = set()
    for name in names:
        path = os.path.join(universal, "zero", name, "step.pt")
        if os.path.isfile(path):
            found.add(checked_step(load_file(path), tag_dir))
    if not found:
        inner = optim.get("optimizer_state_dict") or {}
        for entry in (inner.get("state") or {}).values():
            if isinstance(entry, dict) and "step" in entry:
                found.add(checked_step(entry["step"], tag_dir))
    if not found:
        group = (optim.get("param_groups") or [{}])[0]
        if "step" in group:
            found.add(checked_step(group["step"], tag_dir))
    if len(found) != 1:
        raise UserError(
            f"the optimizer's step count is {sorted(found) or 'missing'} (expected "
            "one value for every parameter)"
        )
    return found.pop()


def _parts(source: Source, mapping: dict[str, str], layers: dict[str, int], total: int) -> list:
    """Stage boundaries [0, ..., total] of a pipeline checkpoint (each model-state file is one
    stage, in order); [0, total] otherwise or when the stages do not cut the layers in order."""
    if not source.pipeline or len(source.stage_names) < 2:
        return [0, total]
    firsts = [
        min((layers[mapping[n]] for n in names if not n.startswith("tied_modules.")), default=0)
        for names in source.stage_names
    ]
    cuts = [0, *firsts[1:], total]  # stage 0 starts at 0 (its first may be a tied embedding)
    return cuts if cuts == sorted(set(cuts)) else [0, total]


def _manifest(
    source: Source,
    run: RunConfig,
    model: ModelSpec,
    trainer: dict,
    zero_stage: int,
    params: dict,
    parts: list,
) -> dict:
    state = source.state
    step = state["global_steps"]
    ds_config = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    dims = state.get("checkpoint_parallel_dimensions") or {}
    pp = int(dims.get("pp_degree", len(parts) - 1)) if isinstance(dims, dict) else len(parts) - 1
    dp = int(state.get("dp_world_size") or 1)
    samples = state.get("global_samples")
    if not isinstance(samples, int):
        batch = ds_config.get("train_batch_size")
        samples = step * batch if isinstance(batch, int) else 0
    return {
        "format": FORMAT,
        "step": step,
        "job_id": None,
        "consumed_samples": samples,
        "topology": {"pp": pp, "tp": 1, "dp": dp, "world_size": pp * dp},
        "zero_stage": zero_stage,
        "parts": parts,
        "model": model.manifest(),
        "versions": software_versions() | {"deepspeed_checkpoint": str(state.get("ds_version"))},
        "config": mask_config({"run": as_data(run), "deepspeed": ds_config}),
        "corpus": {
            "name": "not recorded (imported from a DeepSpeed checkpoint)",
            "tokens": 0,
            "sha256": "",
        },
        "trainer": trainer,
        "params": params,
        "optim_keys": list(OPTIM_KEYS),
        "imported": {
            "from": "deepspeed",
            "engine": "PipelineEngine" if source.pipeline else "DeepSpeedEngine",
            "tag": os.path.basename(os.path.normpath(source.tag_dir)),
            "naming": naming(list(source.shapes)),
        },
    }


def _convert(source: Source, tmp: str) -> str:
    universal = os.path.join(tmp, "universal", "step")
    try:
        ds_checkpoint.to_universal(source.tag_dir, universal)
    except pickle.UnpicklingError as e:
        raise UserError(refusal(source.tag_dir, e)) from None
    except _CONVERSION_ERRORS as e:
        raise UserError(
            f"{source.tag_dir}: DeepSpeed's universal-checkpoint conversion failed "
            f"({first_line(e)})"
        ) from None
    return universal


def _trainer_state(
    universal: str, names: list[str], optim: dict, sched: dict | None, tag_dir: str
) -> dict:
    group = optim["param_groups"][0]
    # float() only what is a number already: a string "0.1" is refused by _check_param_group,
    # as torch's optimizer would refuse it, not read as 0.1
    betas = group.get("betas")
    return {
        "optimizer_step": _adam_step(universal, names, optim, tag_dir),
        "lr": _float(group["lr"]),
        "lr_scheduler": sched,
        "betas": [_float(b) for b in betas] if isinstance(betas, list | tuple) else betas,
    }


def _float(value: object) -> object:
    """A number (a Python or numpy scalar, or a one-element tensor) as a float; else as is."""
    if isinstance(value, bool) or isinstance(value, str | bytes):
        return value
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return value


def _param_group_file(tag_dir: str) -> str:
    """The optimizer file DeepSpeed's conversion takes the param groups (lr, betas) from: data-
    parallel rank 0's of model-parallel rank 0, the first file of its order."""
    for prefix in ("", "fp16_", "bf16_"):
        path = os.path.join(tag_dir, f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt")
        if os.path.isfile(path):
            return path
    return os.path.join(tag_dir, "*_optim_states.pt")


def _check_param_group(trainer: dict, tag_dir: str, zero_stage: int) -> None:
    """The learning rate and betas a resume would set, checked where they came from."""
    inner = "optimizer_state_dict" if zero_stage == 3 else "base_optimizer_state"
    group = f"optimizer_state_dict.{inner}.param_groups[0]"
    for key, rule in (("lr", LR), ("betas", BETAS)):
        refuse_number(_param_group_file(tag_dir), f"{group}.{key}", trainer[key], rule)


def _write_layers(
    work: str, universal: str, source: Source, mapping: dict[str, str], layers: dict[str, int]
) -> tuple[list[str], dict]:
    """Each layer's model and optimizer file in `work`; (the files, manifest["params"])."""
    by_layer: dict[int, list[str]] = {}
    for theirs in sorted(mapping):
        by_layer.setdefault(layers[mapping[theirs]], []).append(theirs)
    files, params = [], {}
    for layer, names in sorted(by_layer.items()):
        weights, states = {}, {}
        for theirs in names:
            ours, shape = mapping[theirs], source.shapes[theirs]
            weights[ours] = _tensor(universal, theirs, "fp32", shape, source.tag_dir)
            for key in OPTIM_KEYS:
                states[f"{ours}.{key}"] = _tensor(universal, theirs, key, shape, source.tag_dir)
            params[ours] = {"file": model_file(layer), "shape": list(shape), "dtype": "F32"}
        for rel, tensors in ((model_file(layer), weights), (optim_file(layer), states)):
            write_atomic(os.path.join(work, rel), safetensors_bytes(tensors))
            files.append(rel)
    return files, params


def import_deepspeed(path: str, out: str, run: RunConfig, model: ModelSpec) -> tuple[str, dict]:
    """Convert the DeepSpeed checkpoint `path` for `model` into the new dsnd checkpoint root
    `out`; returns (its step directory, its manifest). UserError (nothing written) on any
    problem found before converting; a failure later (the conversion, a result that does not
    verify, e.g. NaN in the optimizer state) removes what was written."""
    source = read_source(path)
    mapping = dsnd_names(source.shapes, model, source.tag_dir)
    sched = _scheduler_state(source.state, source.model_files[0])
    parent = check_out(out)
    layers = layer_indices(model)
    created = not os.path.exists(out)
    name = step_dir_name(source.state["global_steps"])
    work = temporary_dir(out, name)
    try:
        with tempfile.TemporaryDirectory(prefix=".dsnd-import-", dir=parent) as tmp:
            universal = _convert(source, tmp)
            optim = load_file(os.path.join(universal, "zero", "optimizer_state.pt"))
            zero_stage = int(optim.get("zero_stage", 1))
            trainer = _trainer_state(universal, list(mapping), optim, sched, source.tag_dir)
            _check_param_group(trainer, source.tag_dir, zero_stage)
            os.makedirs(work)
            files, params = _write_layers(work, universal, source, mapping, layers)
        parts = _parts(source, mapping, layers, model.num_layers + 3)
        manifest = _manifest(source, run, model, trainer, zero_stage, params, parts)
        write_manifest(work, manifest, files)
        check_intact(work)  # what `dsnd ckpt verify` checks, before it becomes a checkpoint
        final = publish(out, work, name)
    except BaseException:
        shutil.rmtree(out if created else work, ignore_errors=True)
        raise
    return final, manifest
