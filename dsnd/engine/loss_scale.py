"""fp16's loss scale: what a pipeline stage multiplies its backward by, and its saved state.

With fp16 every stage's gradients must carry the same factor, the loss scale, which the
optimizer divides out at the step (DeepSpeed's dynamic scaler skips a step whose gradients
overflowed and halves the scale; all stages agree on the overflow because dsnd's mpu makes the
whole replica DeepSpeed's model-parallel group). Only the last stage has a loss; the others
backpropagate the gradient they receive, which already carries the scale. Two DeepSpeed 0.19.8
facts decide what a stage hands to `engine.backward`:
- With a ZeRO optimizer (stages 1-3) `engine.backward` multiplies every scalar it is given by
  the scale (`ZeROOptimizer.scale_if_loss`), also the surrogate ``(output * grad).sum()`` of an
  inner stage, whose gradient is scaled already: so the surrogate is divided by the scale
  first, in fp32 (the scale is a power of two, or a static value: ``s * (x / s)`` is exact).
- At ZeRO-0 fp16 (`FP16_Optimizer` / `FP16_UnfusedOptimizer`) `engine.backward` does not scale
  at all, while the optimizer's step divides by the scale (left so, one SGD step at scale 256
  moves the weights 1/256 of the way; the ZeRO-0 case of `tests/distributed/test_fp16.py` holds
  the losses to fp32's); so the last stage multiplies its loss by the scale itself.
Where the scale is 1 (bf16, fp32) both are no-ops.

The scaler's state (scale, its iteration counters and hysteresis) lives on the optimizer: a
`loss_scaler` object (ZeRO 1-3) or a `loss_scale_config` (ZeRO-0's fp16 optimizers). A
checkpoint saves it so that a resumed run skips and rescales exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch

SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
"""The scaler's changing state (its settings come from the JSON)."""


def _scaler(engine: Any) -> Any | None:
    """The object holding the loss scale, or None where there is none (BF16_Optimizer, fp32
    torch optimizers at ZeRO-0)."""
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    return scaler if scaler is not None else getattr(opt, "loss_scale_config", None)


def scales_gradients(engine: Any) -> bool:
    """Whether this engine trains with a loss scale (fp16)."""
    return bool(engine.fp16_enabled()) and _scaler(engine) is not None


def current_scale(engine: Any) -> float:
    """The loss scale the next backward must carry (1.0 without fp16)."""
    if not scales_gradients(engine):
        return 1.0
    return float(_scaler(engine).cur_scale)


def _engine_scales(engine: Any) -> bool:
    """Whether `engine.backward` multiplies a scalar by the scale itself (ZeRO optimizers)."""
    return getattr(engine.optimizer, "loss_scaler", None) is not None


def loss_for_backward(engine: Any, loss: torch.Tensor) -> torch.Tensor:
    """The last stage's loss as `engine.backward` must get it for gradients carrying the scale."""
    scale = current_scale(engine)
    return loss if scale == 1.0 or _engine_scales(engine) else loss * scale


def surrogate_for_backward(engine: Any, output: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A scalar whose backward through `engine.backward(..., scale_wrt_gas=False)` hands `grad`
    (scaled already by the last stage) to `output` unchanged."""
    surrogate = (output.float() * grad.float()).sum()
    scale = current_scale(engine)
    return surrogate / scale if scale != 1.0 and _engine_scales(engine) else surrogate


def scaler_state(engine: Any) -> dict[str, Any] | None:
    """The scaler's state and DeepSpeed's count of skipped steps, for a checkpoint; None
    without fp16."""
    if not scales_gradients(engine):
        return None
    scaler = _scaler(engine)
    state = {f: getattr(scaler, f) for f in SCALER_FIELDS if getattr(scaler, f, None) is not None}
    state["skipped_steps"] = int(engine.skipped_steps)
    return state


def restore_scaler(engine: Any, state: dict[str, Any] | None) -> None:
    """Put a checkpoint's `scaler_state` back. A checkpoint without one (saved by a bf16 or
    fp32 run) leaves the JSON's initial scale, as a fresh fp16 run would start."""
    if state is None or not scales_gradients(engine):
        return
    scaler = _scaler(engine)
    for field in SCALER_FIELDS:
        if field in state and hasattr(scaler, field):
            setattr(scaler, field, state[field])
    engine.skipped_steps = int(state.get("skipped_steps", 0))


def scale_numbers(engine: Any, scale: float) -> dict[str, Any]:
    """For the metrics row of a step taken at loss scale `scale`, after it: the scale, whether
    DeepSpeed skipped the step (its gradients overflowed) and how many it has skipped in all;
    {} without fp16."""
    if not scales_gradients(engine):
        return {}
    return {
        "loss_scale": scale,
        "skipped": not engine.was_step_applied(),
        "skipped_steps": int(engine.skipped_steps),
    }
