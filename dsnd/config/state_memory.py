"""Model-state bytes of each pipeline stage's ranks for a resolved run: the planner's accounting
(`dsnd.plan.memory`) with the run's ZeRO stage, precision, offload targets, optimizer, tensor
and expert parallelism. What `dsnd ds-config explain` prints and elastic layouts are chosen by."""

from __future__ import annotations

from dsnd.config.resolve import Resolved
from dsnd.plan.memory import model_state_bytes


def offload_targets(ds: dict) -> dict[str, str]:
    """{"offload_optimizer" | "offload_param": device or "none"} of the ZeRO section."""
    zero = ds.get("zero_optimization") or {}
    return {
        key: (zero.get(key) or {}).get("device", "none")
        for key in ("offload_optimizer", "offload_param")
    }


def is_bf16(ds: dict) -> bool:
    return bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"))


def zero_shards(res: Resolved) -> int:
    """The ranks ZeRO partitions a stage's states over: dp x cp, or HSDP's dp_shard groups."""
    t = res.topology
    return t.dp_shard or t.dp * t.cp


def optimizer_state(res: Resolved) -> tuple[str, int]:
    """(the optimizer class DeepSpeed builds, its fp32 bytes of state per parameter)."""
    from dsnd.engine.optimizers import state_bytes  # torch's optimizers, only when asked

    offloaded = res.plan.zero_stage > 0 and offload_targets(res.ds)["offload_optimizer"] in (
        "cpu",
        "nvme",
    )
    return state_bytes(res.ds["optimizer"], offloaded)


def stage_state_bytes(res: Resolved) -> list[dict[str, dict[str, float]]]:
    """Per pipeline stage: {"device": {part: bytes}, "cpu": {part: bytes}} of one of its ranks
    (tensor parallelism splits the dense parameters; MoE blocks' experts stay whole, split over
    ep instead)."""
    t, offload = res.topology, offload_targets(res.ds)
    per_param = optimizer_state(res)[1]
    counts = res.plan.stage_parameters(res.model)
    out = []
    for psi, experts in zip(counts, res.plan.stage_experts(res.model), strict=True):
        local = (psi - experts) // t.tp + experts
        out.append(
            model_state_bytes(
                res.plan.zero_stage,
                local,
                zero_shards(res),
                is_bf16(res.ds),
                offload["offload_optimizer"] == "cpu",
                offload["offload_param"] == "cpu",
                per_param,
                experts=experts,
                ep=t.ep,
            )
        )
    return out
