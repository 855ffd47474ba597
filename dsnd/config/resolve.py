"""From a loaded config and a world size to everything a run needs, checked before any process
group starts: the topology, the model's shape, the batch numbers and the final DeepSpeed dict."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from dsnd.config.batch import GAS, MICRO, TRAIN, Batch, resolve_batch
from dsnd.config.deepspeed_json import check_with_deepspeed
from dsnd.config.load import LoadedConfig
from dsnd.config.presets import PRESETS, ModelDims, with_overrides
from dsnd.config.schema import RunConfig
from dsnd.errors import UserError
from dsnd.topology import Topology


@dataclass
class Resolved:
    """A run, fully determined for one world size."""

    run: RunConfig
    ds: dict[str, Any]  # the DeepSpeed dict handed to deepspeed.initialize
    dims: ModelDims
    topology: Topology
    batch: Batch
    yaml_path: str
    ds_path: str

    @property
    def tokens_per_step(self) -> int:
        return self.batch.train * self.run.model.seq_len


def model_dims(run: RunConfig) -> ModelDims:
    m = run.model
    dims = with_overrides(
        PRESETS[m.preset],
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        ffn_size=m.ffn_size,
        vocab_size=m.vocab_size,
    )
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                 "vocab_size"):  # fmt: skip
        if getattr(dims, name) < 1:
            raise UserError(f"model.{name} must be >= 1, got {getattr(dims, name)}")
    if dims.hidden_size % dims.num_heads:
        raise UserError(
            f"model.hidden_size={dims.hidden_size} is not divisible by "
            f"model.num_heads={dims.num_heads}"
        )
    if dims.num_heads % dims.num_kv_heads:
        raise UserError(
            f"model.num_heads={dims.num_heads} is not divisible by "
            f"model.num_kv_heads={dims.num_kv_heads}"
        )
    if not 1 <= m.seq_len <= dims.max_seq_len:
        raise UserError(f"model.seq_len={m.seq_len} must be in 1..{dims.max_seq_len}")
    return dims


def check_tp(dims: ModelDims, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Megatron splits heads (and hence hidden) and the MLP width across tp ranks, and with
    sequence parallelism the sequence: every count must divide. (The vocabulary is padded.)"""
    for name in ("hidden_size", "num_heads", "num_kv_heads", "ffn_size"):
        value = getattr(dims, name)
        if value % tp:
            raise UserError(f"model.{name}={value} is not divisible by parallel.tp={tp}")
    if sequence_parallel and tp > 1 and seq_len % tp:
        raise UserError(
            f"parallel.sequence_parallel: model.seq_len={seq_len} is not divisible by "
            f"parallel.tp={tp}"
        )


def scale_lr(ds: dict[str, Any], factor: float) -> None:
    """Multiply the optimizer's lr and every scheduler ``*_lr`` parameter by `factor`."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    if "lr" in params:
        params["lr"] *= factor
    sched_params = (ds.get("scheduler") or {}).get("params") or {}
    for key, value in sched_params.items():
        if key.endswith("_lr") and isinstance(value, (int, float)):
            sched_params[key] = value * factor


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")  # fmt: skip
"""Set per rank by every launcher; never copied from the launching environment."""


def resolve(loaded: LoadedConfig, world_size: int) -> Resolved:
    """Check composition rules and derive the DeepSpeed dict for `world_size` ranks."""
    run = loaded.run
    par = run.parallel
    topology = Topology.from_world(world_size, par.pp, par.tp)
    dims = model_dims(run)
    check_tp(dims, par.tp, run.model.seq_len, par.sequence_parallel)
    if par.pp > dims.num_layers:
        raise UserError(f"parallel.pp={par.pp} exceeds model.num_layers={dims.num_layers}")
    for key in ("train.steps", "checkpoint.every", "checkpoint.keep",
                "parallel.activation_checkpoint_interval"):  # fmt: skip
        section, name = key.split(".")
        if getattr(getattr(run, section), name) < 0:
            raise UserError(f"{key} must be >= 0")
    if run.eval.every < 0 or run.eval.batches < 1:
        raise UserError(f"eval.every must be >= 0 and eval.batches >= 1, got {run.eval.every} "
                        f"and {run.eval.batches}")  # fmt: skip
    if run.eval.every and not 0 < run.eval.fraction < 1:
        raise UserError(f"eval.fraction must be in (0, 1), got {run.eval.fraction}")
    if run.train.lr_reference_batch < 1:
        raise UserError("train.lr_reference_batch must be >= 1")
    if not math.isfinite(run.dist.timeout_s) or run.dist.timeout_s <= 0:
        raise UserError(f"dist.timeout_s must be a finite number > 0, got {run.dist.timeout_s}")
    if run.data.max_bytes < 1:
        raise UserError(f"data.max_bytes must be >= 1, got {run.data.max_bytes}")
    for name in run.launch.env:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UserError(f"launch.env: {name!r} is not a variable name")
        if name in RANK_VARIABLES:
            raise UserError(f"launch.env: {name} is set for each rank by the launcher")

    ds = copy.deepcopy(loaded.ds)
    batch = resolve_batch(ds.get(TRAIN), ds.get(MICRO), ds.get(GAS), topology.dp, loaded.ds_path)
    ds[TRAIN], ds[MICRO], ds[GAS] = batch
    if "optimizer" not in ds:
        raise UserError(
            f"{loaded.ds_path}: no 'optimizer' section (dsnd takes the optimizer from the "
            "DeepSpeed JSON)"
        )
    if run.train.lr_scaling != "none":
        ratio = batch.train / run.train.lr_reference_batch
        scale_lr(ds, ratio if run.train.lr_scaling == "linear" else math.sqrt(ratio))
    check_with_deepspeed(ds, loaded.ds_path)
    return Resolved(
        run=run,
        ds=ds,
        dims=dims,
        topology=topology,
        batch=batch,
        yaml_path=loaded.yaml_path,
        ds_path=loaded.ds_path,
    )
