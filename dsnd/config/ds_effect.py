"""Which keys of a DeepSpeed JSON change nothing in this run, or print numbers that differ from
dsnd's, and why.

DeepSpeed accepts every key of its ZeRO config at every stage and reads each only where the
optimizer it builds takes it (`DeepSpeedEngine._configure_zero_optimizer`: ZeRO-1/2's and
ZeRO-3's optimizers take different arguments; stage 0 builds neither), or only in its own
checkpoint and 16-bit save paths, which dsnd does not call. A user who sets one of these keys
expects it to do something: `ds-config check` and the start of a run say that it does not.
"""

from __future__ import annotations

from typing import Any

STAGE3_ONLY = {
    "sub_group_size",
    "offload_param",
    "zero_hpz_partition_size",
    "zero_quantized_nontrainable_weights",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "leaf_module",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
}
"""Keys (DeepSpeed's names and their ``stage3_`` aliases) only ZeRO-3 reads."""

STAGE12_ONLY = {
    "use_multi_rank_bucket_allreduce",
    "allgather_bucket_size",
    "allgather_partitions",
    "round_robin_gradients",
    "ignore_unused_parameters",
    "parameter_alignment",
    "legacy_stage1",
}
"""Keys only ZeRO-1/2's optimizer reads."""

NOT_CALLED = {
    "stage3_gather_16bit_weights_on_model_save": "DeepSpeed reads it in save_16bit_model, "
    "which dsnd does not call (checkpoint.export_hf and dsnd ckpt export gather the weights)",
    "gather_16bit_weights_on_model_save": "DeepSpeed reads it in save_16bit_model, which dsnd "
    "does not call (checkpoint.export_hf and dsnd ckpt export gather the weights)",
    "stage3_gather_fp16_weights_on_model_save": "DeepSpeed reads it in save_16bit_model, which "
    "dsnd does not call (checkpoint.export_hf and dsnd ckpt export gather the weights)",
    "load_from_fp32_weights": "DeepSpeed reads it when it loads its own checkpoints; dsnd "
    "loads its own, which hold the fp32 master weights",
    "elastic_checkpoint": "DeepSpeed reads it when it saves and loads its own checkpoints; "
    "dsnd's checkpoints resume on any layout",
}
"""Keys DeepSpeed reads only on paths dsnd does not take, with the reason."""


def zero_notes(ds: dict[str, Any]) -> list[str]:
    """One note per key of the (filled) JSON's `zero_optimization` section that has no effect
    at its stage or in a dsnd run."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    stage = zero.get("stage", 0)
    bf16 = any(
        isinstance(ds.get(k), dict) and ds[k].get("enabled") is True for k in ("bf16", "bfloat16")
    )
    notes = []
    for key in zero:
        if key in NOT_CALLED:
            why = NOT_CALLED[key]
        elif key == "allgather_bucket_size" and stage == 0 and bf16:
            continue  # DeepSpeed's stage-0 bf16 optimizer gathers in buckets of this size
        elif key != "stage" and stage == 0:
            why = "zero_optimization.stage 0 builds no ZeRO optimizer"
        elif key in STAGE3_ONLY and stage != 3:
            why = f"only ZeRO-3 reads it, and zero_optimization.stage is {stage}"
        elif key in STAGE12_ONLY and stage == 3:
            why = "only ZeRO-1/2 read it, and zero_optimization.stage is 3"
        else:
            continue
        notes.append(f"zero_optimization.{key}: has no effect here: {why}")
    return notes


PRINTS_NEVER = 1_000_000_000
"""The packaged JSONs' steps_per_print: DeepSpeed never reaches it, so it never prints."""


def notes(ds: dict[str, Any]) -> list[str]:
    """Warnings for settings whose DeepSpeed output disagrees with dsnd's own numbers.

    dsnd runs each optimizer step as `gas` calls of the stage's engine (one per micro-batch), so
    DeepSpeed's step-based printing and timers count those calls, not dsnd's steps.
    """
    trust = "dsnd's progress line, metrics.jsonl and TensorBoard are the numbers to trust"
    out = []
    if ds.get("steps_per_print") is not None and ds["steps_per_print"] < PRINTS_NEVER:
        out.append(
            "steps_per_print: DeepSpeed's own progress lines count the per-stage engine's "
            "micro-batch calls, not dsnd's optimizer steps, so their step numbers and lr "
            f"disagree with dsnd's (the lr one step off); {trust}"
        )
    if ds.get("wall_clock_breakdown"):
        out.append(
            "wall_clock_breakdown: DeepSpeed's timers count the per-stage engine's micro-batch "
            "calls, so they put all of a step's time in its first micro-batch and disagree with "
            f"dsnd's step time; {trust}"
        )
    return out
