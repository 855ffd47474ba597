"""ZeRO++'s quantized weights (qwZ, `zero_quantized_weights`) and gradients (qgZ,
`zero_quantized_gradients`): DeepSpeed runs both on its quantizer op (`QuantizerBuilder`), which
its CPU accelerator does not implement. They are allowed where this machine's accelerator can
build that op, and refused by name where it cannot, before any process starts."""

from __future__ import annotations

from typing import Any

from dsnd.engine import deepspeed_api, public

QUANTIZED = {
    "zero_quantized_weights": "ZeRO++ quantized weights (qwZ)",
    "zero_quantized_gradients": "ZeRO++ quantized gradients (qgZ)",
}
_CPU = (
    "which its CPU accelerator does not implement (DeepSpeed: 'This op had not been "
    "implemented on CPU backend.')"
)


def quantized_refusals(accelerator: str, problem: str | None) -> dict[str, str]:
    """The refusal of each quantized switch on DeepSpeed's `accelerator` (its device name) whose
    QuantizerBuilder cannot build for `problem`; none when it can (`problem` None)."""
    if problem is None:
        return {}
    why = (
        _CPU
        if accelerator == "cpu"
        else f"which DeepSpeed's {accelerator} accelerator cannot build here ({problem})"
    )
    return {
        key: f"{what} need DeepSpeed's quantizer op (QuantizerBuilder), {why}; not supported "
        "by dsnd"
        for key, what in QUANTIZED.items()
    }


def quantizer_problem() -> str | None:
    """Why this machine's accelerator cannot build DeepSpeed's QuantizerBuilder, or None: its
    "not implemented" builder (the CPU's), or a builder that says it is not compatible."""
    problem = deepspeed_api.op_problem("QuantizerBuilder")
    if problem is not None:
        return problem
    builder = public.accelerator().create_op_builder("QuantizerBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        return "its QuantizerBuilder is not compatible here (see 'ds_report')"
    return None


def refusals(zero: dict[str, Any]) -> dict[str, str]:
    """The refusals for `zero_optimization` section `zero`, asking the accelerator only when a
    quantized switch is on (the probe imports DeepSpeed's op builders)."""
    if not any(zero.get(key) for key in QUANTIZED):
        return {}
    return quantized_refusals(public.accelerator().device_name(), quantizer_problem())
