"""ZeRO's buffer sizes and optimizer in the DeepSpeed JSON ``dsnd plan --out`` writes, and the
reduce bucket the planner's memory model charges for them.

dsnd's packaged ``zero*.json`` (and the test copies in ``ds_configs/``) are sized for the tiny
models the test suite trains on this CPU, on purpose: ``reduce_bucket_size`` 5e6 elements
(DeepSpeed's 5e8 would allocate a 2 GB bucket on the CPU), ZeRO-3's
``stage3_param_persistence_threshold`` 0 (at DeepSpeed's 1e5 every parameter of a tiny model
would stay whole and ZeRO-3 would shard nothing) and ``torch_adam`` (torch's AdamW, so no test
waits a minute for DeepSpeed's Adam to be JIT-built). Those files stay as they are.

On a GPU those values cost: a bucket of 5e6 elements reduces a 7B model's gradients in ~1400
small collectives; persistence 0 gathers every norm gain and bias through its own all-gather
each forward and backward; and ``torch_adam`` beside a CPU offload of the optimizer runs torch's
AdamW on the CPU, several times slower than DeepSpeed's vectorised CPU Adam. So a plan for a
GPU gets the sizes the Hugging Face integration fills for ``"auto"`` (`dsnd.config.ds_auto`,
from the hidden size h):

    reduce_bucket_size                  h^2        (one (h, h) weight's gradient)
    stage3_prefetch_bucket_size         0.9 h^2
    stage3_param_persistence_threshold  10 h       (norm gains and biases stay whole)

and DeepSpeed's own optimizer (its fused GPU Adam; its CPU Adam when the optimizer is
offloaded): no ``torch_adam``. A plan for this CPU (``--gpu cpu``, what ``--validate`` runs)
keeps the packaged test sizes, which the planner's memory model then charges (`reduce_bucket`).
Whatever the device, ``torch_adam`` never stays beside an offloaded optimizer
(`drop_torch_adam_beside_offload`), and a pipelined ZeRO-3 plan of a model larger than
DeepSpeed's ``sub_group_size`` (1e9 elements) gets one at least the model's size: stages split
into different numbers of sub-groups hang (`dsnd.plan.plan` refuses such a JSON at launch).
"""

from __future__ import annotations

from typing import Any

from dsnd.config.ds_auto import HF_BUCKETS

DEEPSPEED_SUB_GROUP = 1_000_000_000  # DeepSpeed's default sub_group_size (elements)
TEST_BUCKET = 5e6  # reduce_bucket_size (elements) of dsnd's packaged ZeRO JSONs
_STAGE3 = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
_OFFLOADED = ("cpu", "nvme")  # both run the optimizer step on the CPU


def sized_hidden(device_name: str, hidden: int) -> int | None:
    """The hidden size a plan for `device_name` sizes ZeRO's buffers to; None for this CPU
    (the packaged test sizes)."""
    return None if device_name == "cpu" else hidden


def reduce_bucket(hidden: int | None) -> float:
    """``reduce_bucket_size`` (elements) of the JSON emitted for `hidden` (`sized_hidden`)."""
    return TEST_BUCKET if hidden is None else float(HF_BUCKETS["reduce_bucket_size"](hidden))


def gpu_sized(ds: dict[str, Any], hidden: int) -> None:
    """Size `ds`'s ZeRO section to a model of hidden size `hidden` and leave the optimizer
    to DeepSpeed (see the module docstring), in place."""
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage >= 1:
        zero["reduce_bucket_size"] = HF_BUCKETS["reduce_bucket_size"](hidden)
    for key in _STAGE3:
        if stage == 3:
            zero[key] = HF_BUCKETS[key](hidden)
        else:
            zero.pop(key, None)
    _optimizer_params(ds).pop("torch_adam", None)


def drop_torch_adam_beside_offload(ds: dict[str, Any]) -> None:
    """No ``torch_adam`` where the optimizer is offloaded (to the CPU or NVMe): DeepSpeed then
    steps with its CPU Adam instead of torch's AdamW on the CPU. In place."""
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") in _OFFLOADED:
        _optimizer_params(ds).pop("torch_adam", None)


def _optimizer_params(ds: dict[str, Any]) -> dict[str, Any]:
    optimizer = ds.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    return params if isinstance(params, dict) else {}


def one_sub_group_per_stage(ds: dict[str, Any], pp: int, params: int) -> None:
    """At ZeRO-3 with `pp` > 1 stages, a ``sub_group_size`` of at least the model's `params`
    (so at least every stage's) where DeepSpeed's default is smaller. In place."""
    zero = ds.get("zero_optimization") or {}
    size = zero.get("sub_group_size", DEEPSPEED_SUB_GROUP)
    if zero.get("stage") == 3 and pp > 1 and size < params:
        zero["sub_group_size"] = params
