"""From a loaded config and a world size to everything a run needs, checked before any process
group starts: the topology, the model's shape, the batch numbers and the final DeepSpeed dict."""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dsnd.config.batch import GAS, MICRO, TRAIN, Batch, resolve_batch
from dsnd.config.deepspeed_json import (
    check_blamed,
    check_hpz,
    check_keys,
    check_with_deepspeed,
)
from dsnd.config.ds_auto import fill_auto
from dsnd.config.ds_effect import zero_notes
from dsnd.config.ds_monitors import take_monitors
from dsnd.config.load import LoadedConfig
from dsnd.config.lr_schedule import check_lr_keys
from dsnd.config.parallel_rules import (
    check_capacity,
    check_cp,
    check_ep,
    check_reshard,
    check_router_aux,
    check_tp,
    check_zero_degrees,
    zero_stage,
)
from dsnd.config.schema import ModelConfig, RunConfig
from dsnd.config.summary import precision
from dsnd.errors import UserError
from dsnd.model.source import DEFAULT_PRESET, ModelSpec, check_model, load_model, presets
from dsnd.plan.plan import Plan, make_plan
from dsnd.plan.profile import DTYPES, profile_partition, target_device
from dsnd.topology import Topology


@dataclass
class Resolved:
    """A run, fully determined for one world size."""

    run: RunConfig
    ds: dict[str, Any]  # the DeepSpeed dict handed to deepspeed.initialize
    model: ModelSpec
    topology: Topology
    batch: Batch
    plan: Plan  # layout and schedule, resolved once (dsnd.plan)
    yaml_path: str
    ds_path: str
    # the user's DeepSpeed dict (the JSON with --set ds.* applied, nothing derived or scaled):
    # what a rerun starts from, as `ds` would scale the learning rates a second time
    ds_user: dict[str, Any] = field(default_factory=dict)
    # what dsnd filled in ("auto", a missing optimizer) or ignores in the JSON, logged at start
    ds_notes: list[str] = field(default_factory=list)
    # DeepSpeed monitor sections dsnd writes itself: {"tensorboard" | "csv_monitor": directory}
    monitors: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.batch.train * self.run.model.seq_len


SHAPE_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_size",
    "vocab_size",
    "max_position_embeddings",
)


def model_source(m: ModelConfig) -> tuple[str, str]:
    """(what names the architecture, the run key that names it)."""
    if m.config is not None and m.preset is not None and m.config != m.preset:
        raise UserError(
            f"model.config={m.config!r} and model.preset={m.preset!r} name two "
            "models; set one of them"
        )
    if m.preset is not None and m.preset not in presets():
        raise UserError(
            f"model.preset={m.preset!r} is not a preset ({', '.join(presets())}); "
            "name a model directory or config.json with model.config"
        )
    if m.config is not None:
        return m.config, "model.config"
    if m.preset is not None:
        return m.preset, "model.preset"
    if m.init_from is not None:
        return m.init_from, "model.init_from"
    return DEFAULT_PRESET, "model.preset"


def run_model(run: RunConfig) -> ModelSpec:
    """The model the run trains, with its overrides, checked against model.seq_len."""
    m = run.model
    name, key = model_source(m)
    shape = {f: getattr(m, f) for f in SHAPE_FIELDS}
    model = load_model(name, key, shape, m.overrides)
    check_model(model, m.seq_len, model.source)
    return model


def scale_lr(ds: dict[str, Any], factor: float) -> None:
    """Multiply the optimizer's lr and every scheduler ``*_lr`` parameter by `factor`."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    if "lr" in params:
        params["lr"] *= factor
    sched_params = (ds.get("scheduler") or {}).get("params") or {}
    for key, value in sched_params.items():
        if key.endswith("_lr") and isinstance(value, (int, float)):
            sched_params[key] = value * factor


# Integer run keys: key -> (lowest, highest or None)
BOUNDS: dict[str, tuple[int, int | None]] = {
    "train.steps": (0, None),
    "train.seed": (0, 2**63 - 1),
    "train.lr_reference_batch": (1, None),
    "checkpoint.every": (0, None),
    "checkpoint.keep": (0, None),
    "parallel.activation_checkpoint_interval": (0, None),
    "data.max_bytes": (1, None),
    "eval.every": (0, None),
    "eval.batches": (1, None),
    "log.every": (1, None),
}

YEAR_S = 365 * 24 * 3600


def _check_eval(run: RunConfig) -> None:
    """Held-out evaluation and the expert-load warning: values that mean something."""
    if not 0 <= run.eval.fraction < 1:
        raise UserError(f"eval.fraction must be in [0, 1), got {run.eval.fraction}")
    if run.eval.every and not run.eval.fraction and not run.data.eval_path:
        raise UserError(
            f"eval.every={run.eval.every}: nothing to evaluate on (eval.fraction is "
            "0 and data.eval_path is unset)"
        )
    warn = run.log.expert_load_warn
    if not (math.isfinite(warn) and (warn == 0 or warn > 1)):
        raise UserError(
            "log.expert_load_warn must be > 1 (times the mean expert load) or 0 "
            f"(never), got {warn}"
        )


def check_ranges(run: RunConfig) -> None:
    """Refuse values the schema's types allow but a run cannot use (a negative seed fails in the
    sampler, a peak of 0 FLOP/s gives a negative MFU, a timeout past timedelta's range fails when
    the process group starts), each with the number."""
    for key, (low, high) in BOUNDS.items():
        section, name = key.split(".")
        value = getattr(getattr(run, section), name)
        if value is None:  # an optional key left unset (data.max_bytes: no cap)
            continue
        if high is None and value < low:
            raise UserError(f"{key} must be >= {low}, got {value}")
        if high is not None and not low <= value <= high:
            raise UserError(f"{key} must be in {low}..{high}, got {value}")
    _check_eval(run)
    timeout = run.dist.timeout_s
    if not (math.isfinite(timeout) and 0 < timeout <= YEAR_S):
        raise UserError(f"dist.timeout_s must be > 0 and at most {YEAR_S} (a year), got {timeout}")
    cap = run.parallel.profile_memory_cap_gb
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise UserError(f"parallel.profile_memory_cap_gb must be > 0 GiB (or null), got {cap}")
    peak = run.log.peak_flops
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise UserError(f"log.peak_flops must be a FLOP/s rate > 0, got {peak}")
    if not run.log.dir:
        raise UserError("log.dir must not be empty")


def derive_ds(
    ds: dict[str, Any], where: str, run: RunConfig, dp: int, hidden: int
) -> tuple[dict, Batch, list[str], dict[str, str]]:
    """The DeepSpeed dict for `dp` data-parallel ranks — "auto" values and missing optimizer /
    scheduler filled (`ds_auto`), batch keys derived, learning rates scaled by
    train.lr_scaling, checked by dsnd and then by DeepSpeed itself — and the notes on what was
    filled or ignored; errors name `where`.

    Checks the keys first, so every intermediate dict a blame search tries fails as a UserError.
    """
    ds, notes = fill_auto(
        ds,
        hidden,
        run.train.steps,
        run.parallel.pp,
        dp,
        run.train,
        run.model.init_from is not None,
        where,
    )
    notes += check_keys(ds, where) + zero_notes(ds)
    monitors = take_monitors(ds)
    batch = resolve_batch(ds.get(TRAIN), ds.get(MICRO), ds.get(GAS), dp, where)
    ds[TRAIN], ds[MICRO], ds[GAS] = batch
    if run.train.lr_scaling != "none":
        ratio = batch.train / run.train.lr_reference_batch
        scale_lr(ds, ratio if run.train.lr_scaling == "linear" else math.sqrt(ratio))
    check_with_deepspeed(ds, where)
    check_hpz(ds, where)
    return ds, batch, notes, monitors


def run_plan(
    run: RunConfig, model: ModelSpec, topology: Topology, ds: dict[str, Any], batch: Batch
) -> Plan:
    """The run's `Plan`: stages, schedule and every stage's instructions."""
    par = run.parallel
    balance_profile = None
    if isinstance(par.partition, str) and par.partition.lower() == "profile":
        cap = par.profile_memory_cap_gb
        cap_bytes = None if cap is None else int(cap * 2**30)

        def balance_profile(stages: int) -> list[int]:
            # measured on this process, cached under log.dir by config (one measurement per
            # host; dsnd launch measures before any rank starts), checked equal on all ranks
            cache = os.path.join(run.log.dir, "profile-cache")
            # on the device and in the dtype the run trains in: CPU fp32 costs are not a GPU's
            device = target_device(dict(os.environ), torch.cuda.is_available())
            return profile_partition(
                model,
                run.model.seq_len,
                batch.micro,
                stages,
                cache,
                cap_bytes,
                dtype=DTYPES[precision(ds)],
                device=device,
            )[0]

    return make_plan(
        model,
        topology,
        schedule=par.schedule,
        virtual_stages=par.virtual_stages,
        partition_method=par.partition,
        micro_batches=batch.gas,
        zero_stage=zero_stage(ds),
        sequence_parallel=par.sequence_parallel,
        balance_profile=balance_profile,
        sub_group_size=(ds.get("zero_optimization") or {}).get("sub_group_size"),
        expert_parallel=topology.ep,
    )


RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""Set per rank by every launcher; never copied from the launching environment."""


def resolve(loaded: LoadedConfig, world_size: int) -> Resolved:
    """Check composition rules and derive the DeepSpeed dict for `world_size` ranks."""
    run = loaded.run
    par = run.parallel
    topology = Topology.from_world(world_size, par.pp, par.tp, par.cp)
    model = run_model(run)
    check_tp(model, par.tp, run.model.seq_len, par.sequence_parallel)
    check_cp(model, par, run.model.seq_len)
    check_ep(model, par.ep)
    check_router_aux(model, par)
    check_capacity(run, model)
    if run.data.packing == "documents" and par.cp > 1:
        # each rank would hold a slice of every document mask, and ring / Ulysses attention
        # take none: refused rather than attending across documents
        raise UserError(
            f"data.packing=documents: not with parallel.cp={par.cp} (context "
            "parallel attention takes no document mask); use parallel.cp: 1"
        )
    if par.pp > model.num_layers:
        raise UserError(
            f"parallel.pp={par.pp} exceeds the {model.num_layers} blocks of {model.source}"
        )
    check_ranges(run)
    check_lr_keys(run.train)
    for name in run.launch.env:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UserError(f"launch.env: {name!r} is not a variable name")
        if name in RANK_VARIABLES:
            raise UserError(f"launch.env: {name} is set for each rank by the launcher")

    # an error a --set ds.* causes names that item, not the JSON file
    file, sets = (loaded.ds_file, loaded.ds_sets) if loaded.ds_file is not None else (loaded.ds, [])
    # every degree, the ones carved out of dp included, checked together (`dsnd.topology_rules`):
    # ep and dp_shard now, hpZ's size with the DeepSpeed JSON it comes from (and is blamed on)
    topology = replace(topology, ep=par.ep, dp_shard=par.dp_shard or 0)

    def derived(d: dict[str, Any], where: str) -> tuple[tuple, Topology]:
        out = derive_ds(d, where, run, topology.dp, model.hidden_size)
        hpz = (out[0].get("zero_optimization") or {}).get("zero_hpz_partition_size") or 1
        return out, replace(topology, hpz=hpz, hpz_from=where)

    _, ((ds, batch, notes, monitors), topology) = check_blamed(derived, file, loaded.ds_path, sets)
    check_zero_degrees(topology, ds, loaded.ds_path)
    plan = run_plan(run, model, topology, ds, batch)
    check_reshard(par, ds, loaded.ds_path)
    return Resolved(
        run=run,
        ds=ds,
        model=model,
        topology=topology,
        batch=batch,
        plan=plan,
        yaml_path=loaded.yaml_path,
        ds_path=loaded.ds_path,
        ds_user=copy.deepcopy(loaded.ds),
        ds_notes=notes,
        monitors=monitors,
    )
