"""The learning rate a run trains at.

The DeepSpeed JSON's numbers are used as written. What it leaves to the caller — ``"auto"``
values, ``"scheduler": {"type": "auto"}`` (the packaged JSONs'; dsnd's extension of the "auto"
convention, as DeepSpeed itself reads no "auto"), or no optimizer and no scheduler at all —
comes from the run's `train.lr`, `train.warmup_steps`, `train.lr_decay` and `train.min_lr`, as
the Hugging Face Trainer fills a JSON's "auto" values from its TrainingArguments, and for the
keys not set from a recipe: dsnd's (training from scratch: AdamW 3e-3, betas (0.9, 0.95),
weight decay 0.1, a linear warm-up from 3e-4 over 5 steps, then constant) or, with
`model.init_from`, the Hugging Face Trainer's fine-tuning defaults (AdamW 5e-5, betas (0.9,
0.999), eps 1e-8, weight decay 0, no warm-up, linear decay to 0 over train.steps). A key set
where the JSON has a different number is refused, naming both. An optimizer without a scheduler
runs at its lr, constant, as DeepSpeed runs it, unless train.warmup_steps, train.lr_decay or
train.min_lr ask for a schedule.

The decays are DeepSpeed's schedulers (0.19.8, deepspeed/runtime/lr_schedules.py). Step k of a
run (from 1) trains at the rate the scheduler set after k - 1 of its steps, at position
it = k - 2 (its constructor's -1 for step 1); W = warmup_num_steps, which they raise to 2:
- constant = WarmupLR: warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g, g = it / W during
  the warm-up ("linear"), then 1: steps 1 and 2 at warmup_min_lr. No warm-up: warmup_min_lr =
  warmup_max_lr, one rate throughout.
- linear = WarmupDecayLR: the same warm-up, then g = (total_num_steps - it) / (total_num_steps
  - W), down to warmup_min_lr, which is also where the warm-up starts: without a warm-up (W
  raised to 2) steps 1 and 2 run at train.min_lr and step 3 halfway up, as a Hugging Face
  Trainer run with its WarmupDecayLR JSON does.
- cosine = WarmupCosineLR: ratios of the optimizer's lr, the warm-up from warmup_min_ratio, then
  cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2, p = (it - W + 1) /
  (total_num_steps - W) up to 1; its constructor sets ratio 0, so step 1 runs at lr 0.
train.min_lr is warmup_min_lr (constant, linear) or cos_min_ratio x lr and warmup_min_ratio x lr
(cosine).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from dsnd.config.ds_checks import is_number
from dsnd.config.schema import TrainConfig
from dsnd.errors import UserError

AUTO = "auto"
DECAYS = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
KEYS = ("lr", "warmup_steps", "lr_decay", "min_lr")
"""The train.* keys, by their name in the plan."""
SCHEDULE_KEYS = ("warmup_steps", "lr_decay", "min_lr")
"""The keys that ask for a schedule where the JSON has an optimizer and no scheduler."""


@dataclass(frozen=True)
class Recipe:
    """What a run takes where neither the JSON nor a train.* key says."""

    source: str  # how the notes name it
    lr: float
    warmup_steps: int
    lr_decay: str
    min_lr: float  # at lr
    min_ratio: float  # min_lr / lr for another lr
    optimizer: dict  # the other optimizer "auto"s


DSND = Recipe(
    "dsnd's default",
    3e-3,
    5,
    "constant",
    3e-4,
    0.1,
    {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
)
FINE_TUNE = Recipe(
    "the Hugging Face Trainer's fine-tuning default, with model.init_from",
    5e-5,
    0,
    "linear",
    0.0,
    0.0,
    {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
)


def check_lr_keys(train: TrainConfig) -> None:
    """The train.* learning-rate keys' own ranges (before the JSON is read)."""
    for key in ("lr", "min_lr"):
        value = getattr(train, key)
        if value is not None and value < 0:
            raise UserError(f"train.{key} must be >= 0 (or null), got {value}")
    if train.warmup_steps is not None and train.warmup_steps < 0:
        raise UserError(f"train.warmup_steps must be >= 0 (or null), got {train.warmup_steps}")


FINE_TUNE_LINE = (
    "model.init_from: what the JSON leaves to the run takes the Hugging Face Trainer's "
    "fine-tuning defaults (TrainingArguments: learning_rate 5e-05, warmup_steps 0, "
    "lr_scheduler_type linear, adam_beta1 0.9, adam_beta2 0.999, adam_epsilon 1e-08, "
    "weight_decay 0.0), each said above; train.lr, train.warmup_steps, train.lr_decay and "
    "train.min_lr change them"
)
"""The start line of a fine-tune that took any of them."""
NO_SCHEDULER = "DeepSpeed's run of an optimizer without a scheduler"
"""The source of warmup_steps 0 and lr_decay constant where the JSON has only an optimizer."""
OTHER_SCHEDULERS = ("OneCycle", "LRRangeTest")
"""DeepSpeed's schedulers whose rates are their own parameters (no warm-up to fill)."""


@dataclass
class Plan:
    """The run's lr, warmup_steps, lr_decay and min_lr, each with where it comes from."""

    values: dict[str, Any]
    sources: dict[str, str]
    recipe: Recipe
    fine_tune_used: bool = False  # a value of FINE_TUNE went into the JSON

    def used(self, source: str) -> str:
        self.fine_tune_used |= source == FINE_TUNE.source
        return source


def _section(ds: dict[str, Any], name: str) -> tuple[Any, dict[str, Any]]:
    """(type, params) of a section (its params made {} where it has none, as DeepSpeed reads
    them), a detached {} for params that are not an object (the checks after this refuse
    them)."""
    section = ds.get(name)
    if not isinstance(section, dict):
        return None, {}
    if section.get("params") is None:
        section["params"] = {}
    params = section["params"]
    return section.get("type"), params if isinstance(params, dict) else {}


def _finite(value: Any) -> bool:
    """A number the plan can take (others are left for the checks after this to refuse)."""
    return is_number(value) and math.isfinite(value)


def _json_numbers(opt: dict, kind: Any, sched: dict) -> dict[str, tuple[Any, str]]:
    """What the JSON's own numbers say of each plan key (min_ratio: WarmupCosineLR's
    cos_min_ratio, a share of lr), with their path."""
    out: dict[str, tuple[Any, str]] = {}
    warmup_lr = kind in ("WarmupLR", "WarmupDecayLR")
    if warmup_lr and _finite(sched.get("warmup_max_lr")):
        out["lr"] = (sched["warmup_max_lr"], "scheduler.params.warmup_max_lr")
    elif _finite(opt.get("lr")):
        out["lr"] = (opt["lr"], "optimizer.params.lr")
    if kind in DECAYS.values() and _finite(sched.get("warmup_num_steps")):
        out["warmup_steps"] = (sched["warmup_num_steps"], "scheduler.params.warmup_num_steps")
    if warmup_lr and _finite(sched.get("warmup_min_lr")):
        out["min_lr"] = (sched["warmup_min_lr"], "scheduler.params.warmup_min_lr")
    if kind == "WarmupCosineLR" and _finite(sched.get("cos_min_ratio")):
        out["min_ratio"] = (sched["cos_min_ratio"], "scheduler.params.cos_min_ratio")
    return out


def _plan(
    keys: dict[str, Any], json_values: dict, defaults: dict[str, tuple[Any, str]], recipe: Recipe
) -> Plan:
    """Each value from its train.* key, else the JSON's number, else `defaults` (min_lr: in
    the recipe's proportion to lr; "min_ratio": min_lr / lr where a ratio gave it)."""
    values, sources = {}, {}
    for key in KEYS:
        if key in keys:
            values[key], sources[key] = keys[key], f"train.{key}"
        elif key in json_values:
            value, path = json_values[key]
            values[key], sources[key] = value, f"the JSON's {path}"
        elif key == "min_lr" and "min_ratio" in json_values:
            ratio, path = json_values["min_ratio"]
            values[key], sources[key] = ratio * values["lr"], f"the JSON's {path}"
            values["min_ratio"] = ratio
        elif key == "min_lr":
            lr = values["lr"]  # at 12 digits: 1e-6, not the product's 1.0000000000000002e-06
            scaled = float(f"{recipe.min_ratio * lr:.12g}")
            values[key] = recipe.min_lr if lr == recipe.lr else scaled
            values["min_ratio"], sources[key] = recipe.min_ratio, recipe.source
        else:
            values[key], sources[key] = defaults[key]
    return Plan(values, sources, recipe)


def _clash(where: str, path: str, value: Any, key: str, want: Any) -> None:
    if _finite(value) and not math.isclose(value, want, rel_tol=1e-12):
        raise UserError(
            f"{where}: {path} is {value:g}, and train.{key} is {want:g}: set one of "
            'them ("auto" in the JSON takes the run\'s)'
        )


def _refuse(
    keys: dict[str, Any], opt: dict, kind: Any, json_values: dict, plan: Plan, where: str
) -> None:
    """A train.* key set where the JSON says otherwise: one line naming both."""
    if kind in OTHER_SCHEDULERS and keys:
        key = next(iter(keys))
        raise UserError(
            f"{where}: scheduler.type is {kind}, which sets the learning rate by its "
            f"own params; train.{key}={keys[key]} applies to WarmupLR, "
            "WarmupDecayLR and WarmupCosineLR only: remove one of them"
        )
    if kind in DECAYS.values() and "lr_decay" in keys and DECAYS[keys["lr_decay"]] != kind:
        raise UserError(
            f"{where}: scheduler.type is {kind}, and train.lr_decay="
            f"{keys['lr_decay']} is {DECAYS[keys['lr_decay']]}: set one of them "
            '("type": "auto" in the JSON takes the run\'s)'
        )
    if "lr" in keys:
        _clash(where, "optimizer.params.lr", opt.get("lr"), "lr", keys["lr"])
    for key, (value, path) in json_values.items():
        if key in keys:  # warm-up: DeepSpeed refuses 0 steps, and 1 is none (raised to 2)
            want = max(keys[key], 1) if key == "warmup_steps" else keys[key]
            _clash(where, path, value, key, want)
    lr, min_lr = plan.values["lr"], plan.values["min_lr"]
    if "min_lr" in keys and "min_ratio" in json_values:
        _clash(
            where,
            f"scheduler.params.cos_min_ratio x lr {lr:g}",
            json_values["min_ratio"][0] * lr,
            "min_lr",
            min_lr,
        )
    if "min_lr" in keys and min_lr > lr:
        raise UserError(
            f"{where}: train.min_lr={min_lr:g} is above the learning rate {lr:g} "
            f"({plan.sources['lr']})"
        )
    if (
        "min_lr" in keys
        and plan.values["lr_decay"] == "constant"
        and plan.values["warmup_steps"] == 0
    ):
        raise UserError(
            f"{where}: train.min_lr={min_lr:g} has no effect: the rate is constant "
            "(lr_decay constant) without a warm-up; set train.lr_decay or "
            "train.warmup_steps, or remove train.min_lr"
        )


def scheduler_params(kind: str, plan: Plan, steps: int) -> dict[str, tuple[Any, str]]:
    """DeepSpeed's parameters of scheduler `kind` for the plan, each with its source."""
    v, src = plan.values, plan.sources
    lr, warmup, min_lr = v["lr"], v["warmup_steps"], v["min_lr"]
    linear = ("linear", plan.recipe.source)
    if kind == "WarmupCosineLR":
        ratio = v.get("min_ratio", min_lr / lr if lr else 0.0)
        return {
            "total_num_steps": (steps, "train.steps"),
            "warmup_min_ratio": (ratio, src["min_lr"]) if warmup else (1.0, src["warmup_steps"]),
            "warmup_num_steps": (max(warmup, 1), src["warmup_steps"]),
            "cos_min_ratio": (ratio, src["min_lr"]),
            "warmup_type": linear,
        }
    start = (
        (min_lr, src["min_lr"]) if warmup or kind == "WarmupDecayLR" else (lr, src["warmup_steps"])
    )
    params = {
        "warmup_min_lr": start,
        "warmup_max_lr": (lr, src["lr"]),
        "warmup_num_steps": (max(warmup, 1), src["warmup_steps"]),
        "warmup_type": linear,
    }
    if kind == "WarmupDecayLR":
        return {"total_num_steps": (steps, "train.steps"), **params}
    return params


FILLED_BY_KEY = {
    "warmup_max_lr": "lr",
    "warmup_min_lr": "min_lr",
    "warmup_num_steps": "warmup_steps",
    "cos_min_ratio": "min_lr",
}
"""A named scheduler's parameters that a train.* key set fills where the JSON has none (where
DeepSpeed's default would otherwise win over the key)."""


def _fill_named(sched: dict, want: dict, keys: dict, plan: Plan, notes: list[str]) -> None:
    for key, (value, source) in want.items():
        if sched.get(key) == AUTO or (FILLED_BY_KEY.get(key) in keys and key not in sched):
            was = "'auto'" if key in sched else "none"
            sched[key] = value
            notes.append(f"scheduler.params.{key}: {was} -> {value} ({plan.used(source)})")


def _fill_optimizer(opt: dict, plan: Plan, keys: dict, notes: list[str] | None) -> None:
    """The optimizer's "auto"s (and its lr where train.lr is set and the JSON has none);
    `notes` None: a section dsnd added, said whole by the caller."""
    said: list[str] = [] if notes is None else notes
    for key, value in list(opt.items()):
        if value != AUTO or (key != "lr" and key not in plan.recipe.optimizer):
            continue
        if key == "lr":
            opt[key], source = plan.values["lr"], plan.sources["lr"]
        else:
            opt[key], source = copy.deepcopy(plan.recipe.optimizer[key]), plan.recipe.source
        said.append(f"optimizer.params.{key}: 'auto' -> {opt[key]} ({plan.used(source)})")
    if "lr" in keys and "lr" not in opt:
        opt["lr"] = keys["lr"]
        said.append(f"optimizer.params.lr: none -> {opt['lr']} (train.lr)")


def _why(plan: Plan) -> str:
    """Where the plan's values come from: one source, or each key's."""
    sources = [plan.used(plan.sources[k]) for k in KEYS]
    if len(set(sources)) == 1:
        return sources[0]
    return ", ".join(f"{k} from {s}" for k, s in zip(KEYS, sources, strict=True))


def _added(ds: dict[str, Any], keys: dict[str, Any]) -> list[str]:
    """The sections dsnd adds: both when the JSON has neither (the caller's, as Megatron and the
    Hugging Face Trainer supply theirs), the optimizer when it has a scheduler only, and an
    "auto" scheduler when it has an optimizer only and a train.* key asks for a schedule."""
    added = []
    if "optimizer" not in ds:
        ds["optimizer"] = {"type": "AdamW", "params": {k: AUTO for k in ("lr", *DSND.optimizer)}}
        added.append("optimizer")
    if "scheduler" not in ds and (added or set(SCHEDULE_KEYS) & set(keys)):
        ds["scheduler"] = {"type": AUTO, "params": {}}
        added.append("scheduler")
    return added


def _chosen(kind: Any, keys: dict, defaults: dict) -> tuple[Any, tuple[str, str]]:
    """(the scheduler type the run gets, (its decay, where that comes from))."""
    if "lr_decay" in keys:
        decay = (keys["lr_decay"], "train.lr_decay")
    elif kind in DECAYS.values():
        decay = (next(d for d, k in DECAYS.items() if k == kind), "the JSON's scheduler.type")
    else:
        decay = defaults["lr_decay"]
    return (DECAYS[decay[0]] if kind == AUTO else kind), decay


def _fill_scheduler(
    ds: dict[str, Any],
    chosen: Any,
    plan: Plan,
    keys: dict,
    steps: int,
    added: bool,
    notes: list[str],
) -> None:
    """The scheduler section as the plan says: built whole for "type": "auto" (with the JSON's
    numbers kept), its "auto"s filled for a named one, none kept none."""
    kind, sched = _section(ds, "scheduler")
    raw = ds["scheduler"].get("params") if kind is not None else None
    if kind == AUTO and not (raw is None or isinstance(raw, dict)):
        ds["scheduler"]["type"] = chosen  # its params, not an object, are the checks' to refuse
    elif kind == AUTO:
        want = scheduler_params(chosen, plan, steps)
        params = {k: v for k, (v, _) in want.items()} | {
            k: v for k, v in sched.items() if v != AUTO or k not in want
        }
        ds["scheduler"] = {"type": chosen, "params": params}
        was = "none in the JSON" if added else "'auto'"
        notes.append(f"scheduler: {was} -> {chosen} {json.dumps(params)} ({_why(plan)})")
    elif kind in DECAYS.values():
        _fill_named(sched, scheduler_params(kind, plan, steps), keys, plan, notes)
    elif "scheduler" not in ds and isinstance(ds.get("optimizer"), dict):
        opt = _section(ds, "optimizer")[1]
        rate = f"lr {opt['lr']}" if "lr" in opt else "default lr"
        notes.append(
            f"scheduler: none in the JSON -> the optimizer's {rate}, constant, as "
            "DeepSpeed runs it (train.warmup_steps, train.lr_decay or train.min_lr add "
            "a schedule)"
        )


def fill_lr(
    ds: dict[str, Any],
    train: TrainConfig,
    fine_tune: bool,
    steps: int,
    where: str,
    notes: list[str],
) -> None:
    """Fill `ds` (in place) as the module docstring says, one note per decision."""
    keys = {k: getattr(train, k) for k in KEYS if getattr(train, k) is not None}
    recipe = FINE_TUNE if fine_tune else DSND
    defaults = {k: (getattr(recipe, k), recipe.source) for k in ("lr", "warmup_steps", "lr_decay")}
    if "scheduler" not in ds and isinstance(ds.get("optimizer"), dict):
        defaults |= {"warmup_steps": (0, NO_SCHEDULER), "lr_decay": ("constant", NO_SCHEDULER)}
    added = _added(ds, keys)
    _, opt = _section(ds, "optimizer")
    kind, sched = _section(ds, "scheduler")
    chosen, defaults["lr_decay"] = _chosen(kind, keys, defaults)
    json_values = _json_numbers(opt, chosen, sched)
    plan = _plan(keys, json_values, defaults, recipe)
    _refuse(keys, opt, kind, json_values, plan, where)
    _fill_optimizer(opt, plan, keys, None if "optimizer" in added else notes)
    if "optimizer" in added:
        notes.append(
            f"optimizer: none in the JSON -> {ds['optimizer']['type']} "
            f"{json.dumps(opt)} ({plan.used(plan.recipe.source)})"
        )
    _fill_scheduler(ds, chosen, plan, keys, steps, "scheduler" in added, notes)
    if plan.fine_tune_used:
        notes.append(FINE_TUNE_LINE)
