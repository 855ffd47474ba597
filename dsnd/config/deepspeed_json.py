"""The DeepSpeed JSON: load, merge ``--set ds.*`` overrides, and check it strictly.

DeepSpeed itself ignores unknown top-level keys (``train_batch_szie`` silently trains with the
default) and reports nested errors as pydantic tracebacks. dsnd checks every key first and refuses,
by name, the DeepSpeed features it does not run.
"""

from __future__ import annotations

import copy
import inspect
import json
from typing import Any

from dsnd.config.strict import did_you_mean
from dsnd.errors import UserError

# Top-level keys dsnd passes to DeepSpeed as they are.
SUPPORTED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "gradient_clipping", "zero_optimization", "bf16", "bfloat16",
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "comms_logger",
    "flops_profiler", "data_types", "timers", "disable_allgather",
}  # fmt: skip

# Types of top-level scalars; DeepSpeed reads these without checking them.
TOP_TYPES: dict[str, tuple[type, ...]] = {
    "gradient_clipping": (int, float), "steps_per_print": (int,), "wall_clock_breakdown": (bool,),
    "memory_breakdown": (bool,), "dump_state": (bool,), "prescale_gradients": (bool,),
    "gradient_predivide_factor": (int, float), "zero_allow_untested_optimizer": (bool,),
    "zero_force_ds_cpu_optimizer": (bool,), "disable_allgather": (bool,),
    "zero_optimization": (dict,), "optimizer": (dict,), "scheduler": (dict,),
}  # fmt: skip

# Top-level keys DeepSpeed knows and dsnd refuses, with the reason.
REFUSED = {
    "fp16": "fp16 loss scaling is not supported by dsnd; use bf16",
    "amp": "apex AMP is not supported by dsnd; use bf16",
    "torch_autocast": "torch autocast is not supported by dsnd; use bf16",
    "pipeline": "dsnd runs its own pipeline schedule; set parallel.pp in the run YAML",
    "tensor_parallel": "DeepSpeed AutoTP is not used; set parallel.tp in the run YAML",
    "sequence_parallel_size": "Ulysses sequence parallelism is not supported by dsnd",
    "activation_checkpointing": "set activation checkpointing in the run YAML",
    "checkpoint": "dsnd writes its own checkpoints; set checkpoint.* in the run YAML",
    "tensorboard": "dsnd writes its own logs; set log.dir in the run YAML",
    "wandb": "the wandb monitor is not supported by dsnd",
    "csv_monitor": "dsnd writes its own metrics; set log.dir in the run YAML",
    "comet": "the comet monitor is not supported by dsnd",
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
    "aio": "NVMe offload is not supported by dsnd",
    "nebula": "Nebula checkpointing is not supported by dsnd",
    "compile": "torch.compile through DeepSpeed is not supported by dsnd",
    "sparse_gradients": "sparse gradients are not supported by dsnd",
    "expert_parallel": "mixture-of-experts parallelism is not supported by dsnd",
    "zenflow": "ZenFlow is not supported by dsnd",
}

# zero_optimization keys DeepSpeed knows and dsnd refuses.
ZERO_REFUSED = {
    "offload_param": "ZeRO offload is not supported by dsnd",
    "offload_optimizer": "ZeRO offload is not supported by dsnd",
    "cpu_offload": "ZeRO offload is not supported by dsnd",
    "cpu_offload_param": "ZeRO offload is not supported by dsnd",
    "zenflow": "ZenFlow is not supported by dsnd",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning is not supported by dsnd",
    "zero_quantized_weights": "ZeRO++ quantized weights are not supported by dsnd",
    "zero_quantized_gradients": "ZeRO++ quantized gradients are not supported by dsnd",
}

OPTIMIZERS = {"adam", "adamw"}
OPTIMIZER_PARAMS = {
    "lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode", "bias_correction",
    "foreach", "fused", "maximize", "capturable", "differentiable",
}  # fmt: skip
_NUMBER_PARAMS = {"lr", "eps", "weight_decay"}
_BOOL_PARAMS = OPTIMIZER_PARAMS - _NUMBER_PARAMS - {"betas"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_and_params(section: Any, name: str, path: str) -> tuple[str, dict[str, Any]] | None:
    """An ``{"type": ..., "params": {...}}`` section (optimizer, scheduler) as (type, params),
    None when absent, or a UserError."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise UserError(f"{path}: {name} must be an object with 'type' and 'params'")
    _check_keys(section, {"type", "params"}, {}, f"{path}: {name}")
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UserError(f"{path}: {name}.params must be an object, got {params!r}")
    return str(section.get("type", "")), params


def _check_param_type(where: str, key: str, value: Any, like: Any) -> None:
    """Refuse `value` unless it has the type of `like` (a default: number, bool or string)."""
    if _is_number(like) and not _is_number(value):
        raise UserError(f"{where}.{key} must be a number, got {value!r}")
    if isinstance(like, (bool, str)) and not isinstance(value, type(like)):
        raise UserError(f"{where}.{key} must be {type(like).__name__}, got {value!r}")


def load_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or a UserError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read DeepSpeed config: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def merge_override(ds: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply ``--set ds.<dotted>=value``: deep-merge, creating parents; None deletes the key."""
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
    elif isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            merge_override(node[last], k, v)
    else:
        node[last] = copy.deepcopy(value)


def _check_keys(section: dict, known: set[str], refused: dict[str, str], where: str) -> None:
    for key in section:
        if key in refused:
            raise UserError(f"{where}: '{key}' is refused: {refused[key]}")
        if key not in known:
            raise UserError(
                f"{where}: unknown key '{key}'" + did_you_mean(key, known | set(refused))
            )


def _pydantic_keys(model: type) -> set[str]:
    keys = set()
    for name, f in model.model_fields.items():
        keys.add(name)
        if f.alias:
            keys.add(f.alias)
    return keys


def check_keys(ds: dict[str, Any], path: str) -> None:
    """Refuse unknown, misspelt and unsupported keys, each named with `path`."""
    _check_keys(ds, SUPPORTED, REFUSED, path)
    for key, types in TOP_TYPES.items():
        value = ds.get(key)
        bad_bool = isinstance(value, bool) and bool not in types
        if value is not None and (bad_bool or not isinstance(value, types)):
            expected = " or ".join("object" if t is dict else t.__name__ for t in types)
            raise UserError(f"{path}: {key} must be {expected}, got {value!r}")
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        known = _pydantic_keys(DeepSpeedZeroConfig) - set(ZERO_REFUSED)
        _check_keys(zero, known, ZERO_REFUSED, f"{path}: zero_optimization")
    for name in ("bf16", "bfloat16"):
        if isinstance(ds.get(name), dict):
            from deepspeed.runtime.precision_config import DeepSpeedBF16Config

            _check_keys(ds[name], _pydantic_keys(DeepSpeedBF16Config), {}, f"{path}: {name}")
    _check_optimizer(ds.get("optimizer"), path)
    _check_scheduler(ds.get("scheduler"), path)


def _check_optimizer(opt: Any, path: str) -> None:
    section = _type_and_params(opt, "optimizer", path)
    if section is None:
        return
    kind, params = section
    if kind.lower() not in OPTIMIZERS:
        raise UserError(
            f"{path}: optimizer.type '{kind}' is not supported by dsnd (supported: Adam, AdamW)"
        )
    _check_keys(params, OPTIMIZER_PARAMS, {}, f"{path}: optimizer.params")
    for key, value in params.items():
        if key in _NUMBER_PARAMS:
            _check_param_type(f"{path}: optimizer.params", key, value, 0.0)
        elif key in _BOOL_PARAMS and value is not None and not isinstance(value, bool):
            raise UserError(f"{path}: optimizer.params.{key} must be bool, got {value!r}")
        elif key == "betas" and not (
            isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
        ):
            raise UserError(f"{path}: optimizer.params.betas must be [beta1, beta2], got {value!r}")


def _check_scheduler(sched: Any, path: str) -> None:
    section = _type_and_params(sched, "scheduler", path)
    if section is None:
        return
    kind, params = section
    from deepspeed.runtime import lr_schedules

    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise UserError(
            f"{path}: scheduler.type '{kind}' is not a DeepSpeed scheduler"
            + did_you_mean(kind, lr_schedules.VALID_LR_SCHEDULES)
            + f" (one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)})"
        )
    signature = inspect.signature(getattr(lr_schedules, kind).__init__).parameters
    known = set(signature) - {"self", "optimizer", "last_batch_iteration"}
    _check_keys(params, known, {}, f"{path}: scheduler.params")
    for key in sorted(known):
        default = signature[key].default
        if key not in params:
            if default is inspect.Parameter.empty:
                raise UserError(f"{path}: scheduler.params.{key} is required by {kind}")
            continue
        # the default's type; a `*_lr` without one (required, or None = "the optimizer's") is a
        # number too, and train.lr_scaling multiplies it
        like = default if default not in (inspect.Parameter.empty, None) else None
        if like is None and key.endswith("_lr"):
            like = 0.0
        if like is not None:
            _check_param_type(f"{path}: scheduler.params", key, params[key], like)


def check_with_deepspeed(ds: dict[str, Any], path: str) -> None:
    """Let DeepSpeed's own config parser check types and values.

    Without a process group DeepSpeed's config sees a world of 1 (it asks ``dist.get_rank()``
    before any mpu), so the check is given the batch of one data-parallel rank; dsnd's batch
    math has already checked the real numbers.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    one_rank = copy.deepcopy(ds)
    one_rank["train_batch_size"] = (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    )
    try:
        DeepSpeedConfig(one_rank)
    except Exception as e:  # DeepSpeed raises AssertionError, ValueError or pydantic errors
        detail = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"{path}: DeepSpeed rejects the config: {detail[:300]}") from None
