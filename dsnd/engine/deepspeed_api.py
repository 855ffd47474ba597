"""The parts of `deepspeed.runtime` dsnd reads outside a running engine: DeepSpeed's own config
models (so a JSON is checked by the code that will read it), its LR schedules, its partition
helpers and its pipeline topology. Each is a thin accessor, so the rest of dsnd never imports
`deepspeed.runtime`; each imports lazily (checking a config must not load DeepSpeed's engine)."""

from __future__ import annotations

import contextlib
import io
import re
from types import ModuleType
from typing import Any


def zero_config_model() -> type:
    """`DeepSpeedZeroConfig`: the pydantic model of `zero_optimization`."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig


def fp16_config_model() -> type:
    """`DeepSpeedFP16Config`: the pydantic model of `fp16`."""
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    return DeepSpeedFP16Config


def bf16_config_model() -> type:
    """`DeepSpeedBF16Config`: the pydantic model of `bf16` / `bfloat16`."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    return DeepSpeedBF16Config


def lr_schedules() -> ModuleType:
    """`deepspeed.runtime.lr_schedules` (VALID_LR_SCHEDULES and the scheduler classes)."""
    from deepspeed.runtime import lr_schedules as module

    return module


def deepspeed_config(ds: dict[str, Any]) -> Any:
    """`DeepSpeedConfig(ds)`: DeepSpeed's parse of a whole JSON (raises what it raises)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(ds)


def default_gradient_clipping() -> float:
    """The `gradient_clipping` DeepSpeed applies when a JSON has none
    (`deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT`: 1.0 in 0.19.8, so clipping is on)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT)


def pipe_topology(pp: int, tp: int, dp: int) -> Any:
    """DeepSpeed's `PipeModelDataParallelTopology` for the same axes."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def unpartitioned_shape(param: Any) -> tuple[int, ...]:
    """A parameter's shape before ZeRO-3 partitioned it (`ds_shape`; a partitioned parameter's
    own `.shape` is its flat local shard), else its shape."""
    return tuple(getattr(param, "ds_shape", param.shape))


def half_precision_support() -> tuple[bool, bool]:
    """(bf16, fp16) on this machine's accelerator, as DeepSpeed's engine will decide it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return bool(accelerator.is_bf16_supported()), bool(accelerator.is_fp16_supported())


def aio_defaults() -> dict[str, Any]:
    """The `aio` section's keys DeepSpeed reads, with their defaults."""
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    return dict(AIO_DEFAULT_DICT)


def async_io_problem() -> str | None:
    """Why DeepSpeed's async_io op (NVMe offload's file I/O) cannot be built here, in DeepSpeed's
    words (its builder compiles a call of libaio's `io_submit`); None when it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # the builder prints its reasons
        if AsyncIOBuilder().is_compatible(verbose=True):
            return None
    text = re.sub(r"\x1b\[[0-9;]*m|\[WARNING\]", "", said.getvalue())
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or "unknown"


def deepspeed_optimizer_names() -> list[str]:
    """DeepSpeed's own `optimizer.type` names (`DEEPSPEED_OPTIMIZERS`, lower case; the engine
    matches them in any case, and builds any other name from torch.optim)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return list(DEEPSPEED_OPTIMIZERS)


def zero_supported_optimizers() -> tuple[type, ...]:
    """The optimizer classes DeepSpeed runs under ZeRO without `zero_allow_untested_optimizer`
    (`ZERO_SUPPORTED_OPTIMIZERS`; Muon's is added when it is built)."""
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    return tuple(ZERO_SUPPORTED_OPTIMIZERS)


def op_problem(builder: str) -> str | None:
    """Why DeepSpeed's op `builder` (a name in `deepspeed.ops.op_builder`, e.g.
    "FusedLambBuilder") cannot load on this machine's accelerator, in DeepSpeed's words: the
    accelerator gives a "not implemented" builder for an op it lacks, whose `load` raises at once
    (nothing is compiled); None otherwise."""
    from deepspeed.ops import op_builder

    instance = getattr(op_builder, builder)()
    if type(instance).__name__ != "NotImplementedBuilder":
        return None
    try:
        instance.load(verbose=False)
    except Exception as e:  # DeepSpeed raises ValueError
        return " ".join(str(e).split())
    return None


def estimate_model_states(
    stage: int, total_params: int, largest_layer_params: int, per_node: int, nodes: int
) -> int:
    """DeepSpeed's own estimate of the model-state bytes per device (`estimate_zero2_` /
    `estimate_zero3_model_states_mem_needs`, no offload, ZeRO-3 with `zero.Init`), for stages 2
    and 3 (DeepSpeed has none for 0 and 1)."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, device = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=False
        )
        return int(device)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, device, _ = estimate_zero3_model_states_mem_needs(
            total_params,
            largest_layer_params,
            num_gpus_per_node=per_node,
            num_nodes=nodes,
            cpu_offload=False,
            cpu_offload_params=False,
            zero_init=True,
        )
        return int(device)
    raise ValueError(f"DeepSpeed estimates ZeRO stages 2 and 3 only, not {stage}")
