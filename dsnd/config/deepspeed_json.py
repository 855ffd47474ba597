"""The DeepSpeed JSON: load, apply ``--set ds.*`` overrides, and check it strictly.

DeepSpeed itself ignores unknown top-level keys (``train_batch_szie`` silently trains with the
default) and reports nested errors as pydantic tracebacks. dsnd checks every key first and refuses,
by name, the DeepSpeed features it does not run. An error that a ``--set ds.*`` item causes names
that item, not the JSON file (which may be the packaged one the user never opened).

The `optimizer` and `scheduler` sections are checked by `dsnd.config.ds_optimizer`, "auto" values
filled by `dsnd.config.ds_auto`; `dsnd.config.ds_checks` holds the checks all sections share.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from dsnd.config import ds_quantized, json_lines
from dsnd.config.ds_auto import remaining_autos
from dsnd.config.ds_checks import check_section_keys
from dsnd.config.ds_monitors import MONITORS, check_monitor
from dsnd.config.ds_offload import check_aio, check_offload, uses_nvme
from dsnd.config.ds_optimizer import check_optimizer, check_scheduler
from dsnd.config.json_lines import MAX_DEPTH
from dsnd.engine import deepspeed_api
from dsnd.engine.deepspeed_api import half_precision_support
from dsnd.errors import UserError, did_you_mean, problems_of, raise_all

T = TypeVar("T")
DsSet = tuple[str, Any, str]
"""A ``--set ds.KEY=VALUE``: (KEY, VALUE, the item as the user wrote it, for messages)."""

# Top-level keys dsnd passes to DeepSpeed as they are.
SUPPORTED = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "zero_optimization",
    "bf16",
    "bfloat16",
    "fp16",
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "comms_logger",
    "flops_profiler",
    "data_types",
    "timers",
    "disable_allgather",
}

# Types of top-level scalars; DeepSpeed reads these without checking them.
TOP_TYPES: dict[str, tuple[type, ...]] = {
    "gradient_clipping": (int, float),
    "steps_per_print": (int,),
    "wall_clock_breakdown": (bool,),
    "memory_breakdown": (bool,),
    "dump_state": (bool,),
    "prescale_gradients": (bool,),
    "gradient_predivide_factor": (int, float),
    "zero_allow_untested_optimizer": (bool,),
    "zero_force_ds_cpu_optimizer": (bool,),
    "disable_allgather": (bool,),
    "zero_optimization": (dict,),
    "optimizer": (dict,),
    "scheduler": (dict,),
}

# Top-level keys DeepSpeed knows and dsnd refuses, with the reason — when they turn something on
# (`inactive`): a section at its do-nothing value is accepted with a note.
REFUSED = {
    "amp": "apex AMP is not supported by dsnd; use bf16",
    "torch_autocast": "torch autocast is not supported by dsnd; use bf16",
    "pipeline": "dsnd runs its own pipeline schedule; set parallel.pp in the run YAML",
    "tensor_parallel": "DeepSpeed AutoTP is not used; set parallel.tp in the run YAML",
    "sequence_parallel_size": (
        "Ulysses sequence parallelism is not supported by dsnd (Megatron's is: "
        "parallel.sequence_parallel with parallel.tp)"
    ),
    "checkpoint": (
        "dsnd writes its own checkpoints (universal: any layout resumes); set checkpoint.dir, "
        "checkpoint.every and checkpoint.keep in the run YAML"
    ),
    "comet": "the comet monitor is not supported by dsnd (log.tensorboard and metrics.jsonl are)",
    "sparse_attention": "sparse attention is not supported by dsnd",
    "curriculum_learning": "curriculum learning is not supported by dsnd",
    "data_efficiency": "DeepSpeed data efficiency is not supported by dsnd",
    "compression_training": "compression training is not supported by dsnd",
    "quantize_training": "quantized training is not supported by dsnd",
    "weight_quantization": "weight quantization is not supported by dsnd",
    "autotuning": "DeepSpeed autotuning is not supported by dsnd",
    "elasticity": "DeepSpeed elasticity is not supported by dsnd",
    "hybrid_engine": "the hybrid engine is not supported by dsnd",
    "eigenvalue": "eigenvalue computation is not supported by dsnd",
    "progressive_layer_drop": "progressive layer drop is not supported by dsnd",
    "nebula": "Nebula checkpointing is not supported by dsnd",
    "compile": "torch.compile through DeepSpeed is not supported by dsnd",
    "sparse_gradients": "sparse gradients are not supported by dsnd",
    "expert_parallel": (
        "DeepSpeed AutoEP is not used; dsnd splits a mixture of experts' experts itself: set "
        "parallel.ep in the run YAML (docs/models.md)"
    ),
    "zenflow": "ZenFlow is not supported by dsnd",
}

IGNORED = {
    "activation_checkpointing": (
        "DeepSpeed applies it only to models that call deepspeed.checkpointing; dsnd "
        "checkpoints activations with parallel.activation_checkpoint_interval"
    ),
    "aio": "it configures NVMe offload, which this JSON does not turn on",
}
"""Top-level sections DeepSpeed reads but that change nothing in a dsnd run: accepted, noted."""

NEAR_MISS = 0.85
"""An unknown key this close to a known one (difflib's ratio) is a typo, refused; any other
unknown key is ignored by DeepSpeed, and by dsnd with a note."""


def inactive(key: str, value: Any) -> bool:
    """Whether top-level section `key` is at its do-nothing value: ``enabled: false`` (for
    `compile`, no ``deepcompile`` either); a `checkpoint` section that loads nothing universal
    (its other keys shape DeepSpeed's own checkpoint files, which dsnd does not write)."""
    if not isinstance(value, dict):
        return value is False or value is None
    if key == "checkpoint":
        return not value.get("load_universal")
    if key == "compile":
        return not value.get("enabled") and not value.get("deepcompile")
    if key == "tensor_parallel":
        tp = value.get("tp") if isinstance(value.get("tp"), dict) else {}
        return (value.get("autotp_size") or 1) <= 1 and (tp.get("tp_size") or 1) <= 1
    return value.get("enabled") is False


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


def _top_level(ds: dict[str, Any], path: str, notes: list[str]) -> None:
    """Top-level keys by value: supported ones pass; a refused feature only when it turns
    something on; ignored sections and unknown keys (DeepSpeed ignores those) with a note, a
    near miss of a known key refused as the typo it is."""
    known = SUPPORTED | set(REFUSED) | set(IGNORED)
    problems = []
    for key, value in ds.items():
        if key == "fp16" and not fp16_enabled(ds):
            notes.append(f"{key}: at its do-nothing value, ignored")
        elif key == "fp16" and not half_precision_support()[1]:
            problems.append(
                f"{path}: fp16 is not supported on this device (DeepSpeed: Type "
                "fp16 is not supported on your device); use bf16 or fp32"
            )
        elif key == "fp16":
            notes.append(
                "fp16: dynamic loss scaling by DeepSpeed; the scale and skipped steps "
                "are in metrics.jsonl and checkpoints"
            )
        if key in SUPPORTED:
            continue
        if key == "aio" and uses_nvme(ds):
            problems += check_aio(value, path, notes)
            continue
        if key in MONITORS:
            problems += check_monitor(key, value, path, notes)
            continue
        if key in REFUSED and inactive(key, value):
            notes.append(f"{key}: at its do-nothing value, ignored")
        elif key in REFUSED:
            problems.append(f"{path}: '{key}' is refused: {REFUSED[key]}")
        elif key in IGNORED:
            notes.append(f"{key}: ignored: {IGNORED[key]}")
        elif difflib.get_close_matches(key, known, n=1, cutoff=NEAR_MISS):
            problems.append(f"{path}: unknown key '{key}'" + did_you_mean(key, known))
        else:
            notes.append(f"{key}: not a key DeepSpeed reads; ignored, as DeepSpeed does")
    raise_all(problems)


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


def fp16_enabled(ds: dict[str, Any]) -> bool:
    """Whether the JSON turns fp16 (with its loss scaling) on."""
    return isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled") is True


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
        partial(_top_level, notes=notes),
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
