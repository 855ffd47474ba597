"""The DeepSpeed JSON's top-level keys: those dsnd passes to DeepSpeed, refuses by name or
ignores with a note (`dsnd.config.deepspeed_json` checks the rest of the JSON)."""

from __future__ import annotations

import difflib
from typing import Any

from dsnd.config.ds_monitors import MONITORS, check_monitor
from dsnd.config.ds_offload import check_aio, uses_nvme
from dsnd.engine.deepspeed_api import half_precision_support
from dsnd.errors import did_you_mean, raise_all

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


def fp16_enabled(ds: dict[str, Any]) -> bool:
    """Whether the JSON turns fp16 (with its loss scaling) on."""
    return isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled") is True


def check_top_level(ds: dict[str, Any], path: str, notes: list[str]) -> None:
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
