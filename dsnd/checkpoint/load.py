"""Load a committed checkpoint into this rank's engine, on any layout (collective per stage).

Every rank reads, for each parameter of its stage, only its tensor-parallel shard of the full
tensors from the files the manifest names (safetensors slices; nothing is unpickled), and sets
the model parameter, the fp32 master and the optimizer state (dsnd/checkpoint/state.py). Then
the learning-rate schedule's position (`restore_schedule`: hyper-parameters are this run's
JSON's), DeepSpeed's step counters and, when the layout is unchanged, this
rank's RNG streams. The caller has verified the checksums before any process group started;
every file is still opened through `verify_mod.member` (inside the step directory, listed, so
checksummed) and every safetensors header is checked against the manifest before a tensor is
read (`contents.tensor_file`).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack

import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from dsnd.checkpoint import rng
from dsnd.checkpoint.contents import expected_tensors, tensor_file
from dsnd.checkpoint.files import CheckpointError, optim_file, rng_file
from dsnd.checkpoint.members import member
from dsnd.checkpoint.verify import read_manifest
from dsnd.config.resolve import Resolved
from dsnd.engine.compat import quiet_scheduler_start, replay_cpu_adam_steps
from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.engine.loss_scale import restore_scaler
from dsnd.engine.state import (
    basic_optimizer,
    materialise_optimizer_state,
    set_full_state,
    unmanaged_masters,
)
from dsnd.model.stack import layer_of
from dsnd.tp.shard import read_part

log = logging.getLogger(__name__)


def _same_layout(manifest: dict, res: Resolved) -> bool:
    t = manifest["topology"]
    mine = res.topology
    return (t["pp"], t["tp"], t["dp"], t.get("cp", 1)) == (mine.pp, mine.tp, mine.dp, mine.cp)


def load_checkpoint(engine, res: Resolved, step_dir: str) -> dict:
    """Restore the training state saved in `step_dir`; returns its manifest."""
    manifest = read_manifest(step_dir)
    trainer = manifest["trainer"]
    keys = manifest["optim_keys"]
    materialise_optimizer_state(engine, keys, trainer["optimizer_step"])
    masters = unmanaged_masters(engine)
    expected = expected_tensors(manifest)
    with ExitStack() as files:
        opened: dict[str, object] = {}

        def stored(file: str, key: str):
            if file not in opened:
                path = tensor_file(step_dir, manifest, expected, file)
                opened[file] = files.enter_context(_open(path))
            return opened[file].get_slice(key)

        for name, param in engine.module.named_parameters():
            meta = manifest["params"].get(name)
            if meta is None:
                raise CheckpointError(f"{step_dir}: the checkpoint has no parameter {name}")
            shape = unpartitioned_shape(param)  # ZeRO-3: the shape before sharding
            try:
                value = read_part(stored(meta["file"], name), param, shape)
                layer = layer_of(name, engine.module)
                states = {
                    k: read_part(stored(optim_file(layer), f"{name}.{k}"), param, shape)
                    for k in keys
                }
            except (ValueError, SafetensorError) as e:
                raise CheckpointError(f"{step_dir}: {name} {e}") from e
            set_full_state(engine, param, value, states, masters)

    restore_schedule(engine.lr_scheduler, trainer["lr_scheduler"], manifest["step"])
    # with this run's betas: DeepSpeedCPUAdam's beta powers as torch's Adam computes them
    replay_cpu_adam_steps(basic_optimizer(engine), trainer["optimizer_step"])
    restore_scaler(engine, trainer.get("loss_scaler"))
    step = manifest["step"]
    engine.global_steps = step
    engine.global_samples = manifest["consumed_samples"]
    engine.micro_steps = step * res.batch.gas

    rel = rng_file(dist.get_rank())
    if _same_layout(manifest, res) and rel in manifest["files"]:
        _restore_rng(member(step_dir, manifest, rel))
    return manifest


def restore_schedule(sched, state: dict | None, step: int) -> None:
    """The learning rate (and OneCycle's momentum) that this run's scheduler gives at the
    checkpoint's position. The checkpoint supplies the optimizer's state and the schedule's
    position only: every hyper-parameter (betas, eps, weight decay, the schedule's numbers) is
    this run's JSON's, as the engine was built with it, so a resume with a changed JSON runs
    what it says, and an unchanged one gives the saved rate bit for bit (the same function at
    the same position). No scheduler: the JSON's lr, constant. A checkpoint saved without one:
    the position its step gives (DeepSpeed steps the scheduler once per optimizer step)."""
    if sched is None:
        return
    sched.load_state_dict(state if state is not None else {"last_batch_iteration": step - 1})
    with quiet_scheduler_start():  # position -1: the warm-up's start, without DeepSpeed's warning
        sched.step(sched.last_batch_iteration)  # set the rate there; the position stays


def _open(path: str):
    """safe_open, with the library's error as one line naming the file."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not readable as safetensors ({e})") from e


def _restore_rng(path: str) -> None:
    """This rank's RNG streams from `path`; a file that is not dsnd's RNG state is one line."""
    try:
        with open(path, encoding="utf-8") as f:
            rng.restore(json.load(f))
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not the RNG state dsnd saves ({e})") from e


def read_full_model(step_dir: str, manifest: dict) -> dict:
    """Every tensor manifest["params"] lists, whole, by dsnd name (for one process: export,
    generate), from files the manifest's checksums cover and whose headers match it."""
    by_file: dict[str, list[str]] = {}
    for name, meta in manifest["params"].items():
        by_file.setdefault(meta["file"], []).append(name)
    expected = expected_tensors(manifest)
    tensors = {}
    for rel, names in sorted(by_file.items()):
        with _open(tensor_file(step_dir, manifest, expected, rel)) as f:
            tensors |= {name: f.get_tensor(name) for name in names}
    return tensors
