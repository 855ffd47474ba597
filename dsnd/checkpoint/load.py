"""Load a committed checkpoint into this rank's engine, on any layout (collective per stage).

Every rank reads, for each parameter of its stage, only its tensor-parallel shard of the full
tensors from the files the manifest names (safetensors slices; nothing is unpickled), and sets
the model parameter, the fp32 master and the optimizer state (dsnd/checkpoint/state.py). Then
the learning-rate schedule, DeepSpeed's step counters and, when the layout is unchanged, this
rank's RNG streams. The caller has verified the checksums before any process group started.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack

import torch.distributed as dist
from safetensors import safe_open

from dsnd.checkpoint import rng
from dsnd.checkpoint.layout import (
    MANIFEST,
    CheckpointError,
    optim_file,
    read_manifest,
    rng_file,
)
from dsnd.checkpoint.state import (
    materialise_optimizer_state,
    set_full_state,
    unmanaged_masters,
)
from dsnd.config.resolve import Resolved
from dsnd.model.specs import layer_of
from dsnd.tp.shard import read_part

log = logging.getLogger(__name__)


def _same_layout(manifest: dict, res: Resolved) -> bool:
    t = manifest["topology"]
    return (t["pp"], t["tp"], t["dp"]) == (res.topology.pp, res.topology.tp, res.topology.dp)


def load_checkpoint(engine, res: Resolved, step_dir: str) -> dict:
    """Restore the training state saved in `step_dir`; returns its manifest."""
    manifest = read_manifest(step_dir)
    trainer = manifest["trainer"]
    keys = manifest["optim_keys"]
    materialise_optimizer_state(engine, keys, trainer["optimizer_step"])
    masters = unmanaged_masters(engine)
    with ExitStack() as files:
        opened: dict[str, object] = {}

        def stored(file: str, key: str):
            if file not in opened:
                path = os.path.join(step_dir, file)
                opened[file] = files.enter_context(safe_open(path, framework="pt"))
            return opened[file].get_slice(key)

        for name, param in engine.module.named_parameters():
            meta = manifest["params"].get(name)
            if meta is None:
                raise CheckpointError(f"{step_dir}: the checkpoint has no parameter {name}")
            try:
                value = read_part(stored(meta["file"], name), param)
                layer = layer_of(name, engine.module)
                states = {k: read_part(stored(optim_file(layer), f"{name}.{k}"), param)
                          for k in keys}  # fmt: skip
            except ValueError as e:
                raise CheckpointError(f"{step_dir}: {name} {e}") from e
            set_full_state(engine, param, value, states, masters)

    sched = engine.lr_scheduler
    if sched is not None and trainer["lr_scheduler"] is not None:
        sched.load_state_dict(trainer["lr_scheduler"])
    for group in engine.optimizer.param_groups:
        group["lr"] = trainer["lr"]
        if trainer["betas"] is not None:
            group["betas"] = tuple(trainer["betas"])
    step = manifest["step"]
    engine.global_steps = step
    engine.global_samples = manifest["consumed_samples"]
    engine.micro_steps = step * res.batch.gas

    rng_path = os.path.join(step_dir, rng_file(dist.get_rank()))
    if _same_layout(manifest, res) and os.path.isfile(rng_path):
        with open(rng_path, encoding="utf-8") as f:
            rng.restore(json.load(f))
    return manifest


def read_full_model(step_dir: str, manifest: dict) -> dict:
    """Every tensor manifest["params"] lists, whole, by dsnd name (for one process: export,
    generate); each file must be one the manifest's checksums cover."""
    by_file: dict[str, dict[str, list[int]]] = {}
    for name, meta in manifest["params"].items():
        by_file.setdefault(meta["file"], {})[name] = list(meta["shape"])
    tensors = {}
    for rel, shapes in sorted(by_file.items()):
        path = os.path.join(step_dir, rel)
        if rel not in manifest["files"]:  # read only files the checksums cover
            raise CheckpointError(f"{path}: holds parameters but is not in {MANIFEST}'s files")
        with safe_open(path, framework="pt") as f:
            stored = set(f.keys())
            for name, shape in shapes.items():
                if name not in stored:
                    raise CheckpointError(f"{path}: no tensor {name}")
                tensor = f.get_tensor(name)
                if list(tensor.shape) != shape:
                    raise CheckpointError(
                        f"{path}: {name} has shape {list(tensor.shape)}, {MANIFEST} says {shape}"
                    )
                tensors[name] = tensor
    if not tensors:
        raise CheckpointError(f"{step_dir}: {MANIFEST} lists no parameters")
    return tensors
