"""ZeRO-Offload's sections of a DeepSpeed JSON: to the CPU or to NVMe (ZeRO-Infinity), and the
`aio` section NVMe offload reads; each problem one line before start."""

from __future__ import annotations

import os
from typing import Any

from dsnd.config.ds_checks import is_number
from dsnd.engine import deepspeed_api
from dsnd.errors import UserError, did_you_mean


def check_offload(zero: dict[str, Any], stage: int, path: str) -> None:
    """ZeRO-Offload runs inside pipeline stages: to the CPU (optimizer: ZeRO 1-3; parameters:
    ZeRO-3, as in DeepSpeed), to NVMe (ZeRO-Infinity) at ZeRO-3 only (DeepSpeed's ZeRO 1/2 would
    offload to the CPU instead) into an existing writable directory, with DeepSpeed's async_io
    op (built on first use; it needs libaio)."""
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, dict) else "none"
        where = f"{path}: zero_optimization.{key}"
        if device == "nvme" and stage != 3:
            raise UserError(f"{where}.device='nvme' needs zero_optimization.stage 3, got {stage}")
        if device == "nvme":
            _check_nvme_path(section.get("nvme_path"), f"{where}.nvme_path")
            problem = deepspeed_api.async_io_problem()
            if problem:
                raise UserError(
                    f"{where}.device='nvme' needs DeepSpeed's async_io op, which "
                    f"cannot be built here: {problem}"
                )
        if device == "cpu" and (stage == 0 or (key == "offload_param" and stage != 3)):
            needs = "3" if key == "offload_param" else "1, 2 or 3"
            raise UserError(
                f"{where}.device='cpu' needs zero_optimization.stage {needs}, got {stage}"
            )


def _check_nvme_path(value: Any, where: str) -> None:
    """DeepSpeed creates its swap folders under `nvme_path` only when the engine starts."""
    if not isinstance(value, str) or not value:
        raise UserError(f"{where} must be the path of a directory, got {value!r}")
    if not os.path.isdir(value) or not os.access(value, os.W_OK | os.X_OK):
        raise UserError(f"{where}: '{value}' is not a writable directory")


def check_aio(value: Any, path: str, notes: list[str]) -> list[str]:
    """The `aio` section with NVMe offload on: DeepSpeed reads its known keys without checking
    them and skips the rest (such as the older `thread_count`)."""
    if not isinstance(value, dict):
        return [f"{path}: aio must be an object, got {value!r}"]
    defaults = deepspeed_api.aio_defaults()
    problems = []
    for k, v in value.items():
        if k not in defaults:
            notes.append(
                f"aio.{k}: not a key DeepSpeed reads; ignored, as DeepSpeed does"
                + did_you_mean(k, defaults)
            )
        elif type(v) is not type(defaults[k]) and not (is_number(v) and is_number(defaults[k])):
            problems.append(f"{path}: aio.{k} must be {type(defaults[k]).__name__}, got {v!r}")
        elif k == "use_gds" and v:
            problems.append(
                f"{path}: aio.use_gds needs CUDA (GPUDirect Storage); this machine's "
                "DeepSpeed accelerator is not CUDA"
            )
    return problems


def uses_nvme(ds: dict[str, Any]) -> bool:
    """Whether the JSON offloads anything to NVMe (then its `aio` section is used)."""
    zero = ds.get("zero_optimization")
    sections = (
        [zero.get(k) for k in ("offload_optimizer", "offload_param")]
        if isinstance(zero, dict)
        else []
    )
    return any(isinstance(s, dict) and s.get("device") == "nvme" for s in sections)
