"""The DeepSpeed JSON: load, apply ``--set ds.*`` overrides, and check it strictly.

DeepSpeed itself ignores unknown top-level keys (``train_batch_szie`` silently trains with the
default) and reports nested errors as pydantic tracebacks. dsnd checks every key first and refuses,
by name, the DeepSpeed features it does not run. An error that a ``--set ds.*`` item causes names
that item, not the JSON file (which may be the packaged one the user never opened).

The `optimizer` and `scheduler` sections are checked by `dsnd.config.ds_optimizer`, "auto" values
filled by `dsnd.config.ds_auto`; `dsnd.config.ds_checks` holds the checks all sections share, and
`dsnd.config.ds_top_level` the top-level keys dsnd passes on, refuses or ignores.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from dsnd.config import ds_quantized, json_lines
from dsnd.config.ds_auto import remaining_autos
from dsnd.config.ds_checks import check_section_keys
from dsnd.config.ds_offload import check_offload
from dsnd.config.ds_optimizer import check_optimizer, check_scheduler
from dsnd.config.ds_top_level import TOP_TYPES, check_top_level
from dsnd.config.json_lines import MAX_DEPTH
from dsnd.engine import deepspeed_api
from dsnd.errors import UserError, problems_of, raise_all

T = TypeVar("T")
DsSet = tuple[str, Any, str]
"""A ``--set ds.KEY=VALUE``: (KEY, VALUE, the item as the user wrote it, for messages)."""


# zero_optimization keys DeepSpeed knows and dsnd refuses (and ZeRO++'s quantized switches
# where the accelerator cannot build their op: `ds_quantized`).
ZERO_REFUSED = {
    "zenflow": "ZenFlow is not supported by dsnd",
    "mics_shard_size": "DeepSpeed 0.19.8 removed MiCS ('MiCS ZeRO-3 sharding has been "
    "removed'); set parallel.dp_shard in the run config instead: ZeRO-3 shards within groups "
    "of that many data-parallel ranks and replicates across them, as MiCS did",
    "mics_hierarchical_params_gather": "DeepSpeed 0.19.8 removed MiCS ('MiCS ZeRO-3 sharding "
    "has been removed'); with parallel.dp_shard ZeRO-3's parameter all-gathers stay inside "
    "each shard group",
}

ZERO_OFF = {
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
}
"""The values at which ZeRO++'s switches turn nothing on: accepted."""


def check_hpz(ds: dict[str, Any], where: str) -> None:
    """ZeRO++ hpZ (`zero_hpz_partition_size`): ZeRO-3 keeps a secondary copy of the parameters
    partitioned over groups of that many consecutive ranks of each stage's data-parallel group
    (`dsnd.topology.Topology.runs_of`, which also checks that it divides dp); a size past dp is
    dp, as DeepSpeed caps it at its world. DeepSpeed's ZeRO 1/2 ignore it."""
    zero = ds.get("zero_optimization") or {}
    size = zero.get("zero_hpz_partition_size") or 1
    if size > 1 and zero.get("stage") != 3:
        raise UserError(
            f"{where}: zero_optimization.zero_hpz_partition_size={size} needs "
            f"zero_optimization.stage 3, got {zero.get('stage', 0)}"
        )


def load_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or a UserError naming the file and line (also for a duplicate
    key, NaN or Infinity, or nesting deeper than MAX_DEPTH, which Python's json lets through)."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # an editor's byte-order mark is no error
            text = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read DeepSpeed config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: cannot read DeepSpeed config: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    try:
        data = json_lines.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except json_lines.JSONProblem as e:
        raise UserError(f"{path}:{e.in_file(text)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def merge_override(ds: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply ``--set ds.<dotted>=value``: set that one key, creating parents; None deletes it.

    An object value replaces the key's object whole (``--set 'ds.scheduler={...}'`` is the new
    scheduler, not the old one's parameters plus the new); only dotted keys change one key.
    """
    *parents, last = dotted.split(".")
    node = ds
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None and value is None:
            return  # deleting below a missing key: nothing to delete, nothing to create
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise UserError(
                f"--set ds.{dotted}: ds.{'.'.join(parents[: i + 1])} is "
                f"{type(child).__name__} {child!r}, not an object"
            )
        node = child
    if value is None:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(value)


def apply_sets(ds: dict[str, Any], sets: Sequence[DsSet]) -> dict[str, Any]:
    """A copy of `ds` with the ``--set ds.*`` items applied in order."""
    out = copy.deepcopy(ds)
    for key, value, _ in sets:
        merge_override(out, key, value)
    return out


def _failure(check: Callable[[dict[str, Any], str], Any], ds: dict, where: str) -> UserError | None:
    try:
        check(copy.deepcopy(ds), where)
    except UserError as e:
        return e
    return None


def check_blamed(
    check: Callable[[dict[str, Any], str], T],
    ds: dict[str, Any],
    where: str,
    sets: Sequence[DsSet],
) -> tuple[dict[str, Any], T]:
    """`ds` with `sets` applied, and what `check(merged, where)` returns.

    When the merged dict fails, the error names its cause: the file (`where`) when the file alone
    fails the same way, else the first ``--set`` after which that failure appears. (The
    intermediate dicts are checked only then, and only their failure that equals the final one
    counts: a --set that a later one completes, such as a new scheduler type and then its
    required parameter, is never blamed.)
    """
    merged = apply_sets(ds, sets)
    try:
        return merged, check(copy.deepcopy(merged), where)
    except UserError:
        if not sets:
            raise
    # each problem (compared without its `where`) is blamed on the first of the file and the
    # --sets from which on it is present in every later dict
    causes = [where, *(label for *_, label in sets)]
    found, current = [], copy.deepcopy(ds)
    for n in range(len(causes)):
        if n:
            merge_override(current, sets[n - 1][0], sets[n - 1][1])
        failure = _failure(check, current, "")
        found.append([] if failure is None else [_bare(p) for p in problems_of(failure)])
    blamed = []
    for problem in found[-1]:
        first = next(n for n in range(len(causes)) if all(problem in f for f in found[n:]))
        blamed.append(f"{causes[first]}: {problem}")
    raise_all(blamed)
    raise AssertionError("not reached: the merged dict failed")


def _bare(problem: str) -> str:
    """A problem checked with an empty `where`, without the ': ' that was its place."""
    return problem[2:] if problem.startswith(": ") else problem


def _pydantic_keys(model: type) -> set[str]:
    keys = set()
    for name, f in model.model_fields.items():
        keys.add(name)
        if f.alias:
            keys.add(f.alias)
    return keys


def check_values(value: Any, where: str) -> None:
    """Refuse NaN and infinities anywhere in `value`, and nesting deeper than MAX_DEPTH.

    The JSON file's parser refuses both already; a ``--set ds.*`` value can still bring them
    (Python's json reads ``NaN``). Iterative, so no depth is too deep to be reported.
    """
    stack: list[tuple[list, Any]] = [([], value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise UserError(
                f"{where}: {json_lines.dotted(path)} must be a finite number, got {node}"
            )
        if isinstance(node, (dict, list)):
            if len(path) >= MAX_DEPTH:
                raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend(([*path, k], v) for k, v in reversed(list(items)))


def _check_ranges(ds: dict[str, Any], path: str) -> None:
    """Values DeepSpeed accepts and then trains nonsense with, or fails on after the process
    group has started (a ZeRO stage past 3, a zero print interval, a negative clip)."""
    stage = (ds.get("zero_optimization") or {}).get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise UserError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    check_offload(ds.get("zero_optimization") or {}, stage or 0, path)
    if ds.get("steps_per_print") is not None and ds["steps_per_print"] < 1:
        raise UserError(f"{path}: steps_per_print must be >= 1, got {ds['steps_per_print']}")
    if ds.get("gradient_clipping") is not None and ds["gradient_clipping"] < 0:
        raise UserError(
            f"{path}: gradient_clipping must be >= 0 (0 = off), got {ds['gradient_clipping']}"
        )


def _check_types(ds: dict[str, Any], path: str) -> None:
    problems = []
    for key, types in TOP_TYPES.items():
        value = ds.get(key)
        bad_bool = isinstance(value, bool) and bool not in types
        if value is not None and (bad_bool or not isinstance(value, types)):
            expected = " or ".join("object" if t is dict else t.__name__ for t in types)
            problems.append(f"{path}: {key} must be {expected}, got {value!r}")
    raise_all(problems)


def _check_sections(ds: dict[str, Any], path: str) -> None:
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict):
        active = {k: v for k, v in zero.items() if k not in ZERO_OFF or v != ZERO_OFF[k]}
        refused = {**ZERO_REFUSED, **ds_quantized.refusals(active)}
        known = _pydantic_keys(deepspeed_api.zero_config_model()) - set(refused)
        check_section_keys(active, known, refused, f"{path}: zero_optimization")
    for name in ("bf16", "bfloat16", "fp16"):
        if isinstance(ds.get(name), dict):
            model = (
                deepspeed_api.fp16_config_model()
                if name == "fp16"
                else deepspeed_api.bf16_config_model()
            )
            check_section_keys(ds[name], _pydantic_keys(model), {}, f"{path}: {name}")


def check_keys(ds: dict[str, Any], path: str) -> list[str]:
    """Refuse misspelt and unsupported keys, wrong types and values out of range — every
    problem at once, each named with `path` — and return the notes on what is ignored."""
    check_values(ds, path)
    notes: list[str] = []
    problems: list[str] = []
    autos = remaining_autos(ds)
    if autos:
        problems.append(
            f"{path}: {', '.join(autos)}: 'auto' is not a value dsnd can fill here; set a value"
        )
    for check in (
        partial(check_top_level, notes=notes),
        _check_types,
        _check_sections,
        _check_ranges,
        lambda d, p: check_optimizer(d.get("optimizer"), p, d),
        lambda d, p: check_scheduler(d.get("scheduler"), p),
    ):
        try:
            check(ds, path)
        except UserError as e:
            problems.extend(problems_of(e))
        except (TypeError, AttributeError):  # a section of the wrong type, reported above
            continue
    raise_all(problems)
    return notes


def check_with_deepspeed(ds: dict[str, Any], path: str) -> None:
    """Let DeepSpeed's own config parser check types and values.

    Without a process group DeepSpeed's config sees a world of 1 (it asks ``dist.get_rank()``
    before any mpu), so the check is given the batch of one data-parallel rank; dsnd's batch
    math has already checked the real numbers.
    """
    one_rank = copy.deepcopy(ds)
    one_rank["train_batch_size"] = (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    )
    from pydantic import ValidationError

    try:
        deepspeed_api.deepspeed_config(one_rank)
    except ValidationError as e:
        raise UserError(f"{path}: DeepSpeed rejects the config: {describe(e, ds)}") from None
    except Exception as e:  # DeepSpeed raises AssertionError, ValueError, TypeError too
        detail = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"{path}: DeepSpeed rejects the config: {detail[:300]}") from None


# DeepSpeed's pydantic models, by title -> the JSON section their error locations start in
MODEL_SECTIONS = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
    "CommsLoggerConfig": "comms_logger",
    "DeepSpeedThroughputTimerConfig": "timers.throughput",
}


def describe(error: Any, ds: dict[str, Any]) -> str:
    """A pydantic ValidationError as one line, ``key.path: message (got value)``, for its first
    error (pydantic's own text is a block of lines with a link per error)."""
    errors = error.errors()
    section = MODEL_SECTIONS.get(error.title)
    if section == "bf16" and "bfloat16" in ds:
        section = "bfloat16"
    first = errors[0]
    key = ".".join(str(p) for p in [*([section] if section else []), *first["loc"]])
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
    return f"{key or error.title}: {first['msg']} (got {got}){more}"
