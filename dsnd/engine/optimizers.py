"""The optimizer DeepSpeed 0.19.8's engine builds for a JSON's `optimizer` section, whether it can
run on this machine, and how much state it keeps — read from DeepSpeed and torch before any
process group starts (nothing here builds a DeepSpeed op).

The engine (`_configure_basic_optimizer`) builds, by `optimizer.type` (DeepSpeed's own names in
any case, any other name as torch spells it):
- adam, adamw: torch's Adam(W) with `torch_adam`, DeepSpeedCPUAdam with the optimizer offloaded
  (ZeRO-Offload, `offload_optimizer.device` cpu or nvme), else FusedAdam;
- adagrad: DeepSpeedCPUAdagrad offloaded, else `torch.optim.Adagrad`;
- lion: DeepSpeedCPULion offloaded, else FusedLion; lamb: FusedLamb (both CUDA kernels);
- muadam, muadamw, musgd: the mup package's MuAdam, MuAdamW, MuSGD; muon: MuonWithAuxAdam;
- any other name: `torch.optim.<name>` with the params as given.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from dsnd.engine import deepspeed_api

KERNELS = {"lamb": ("FusedLamb", "FusedLambBuilder"), "lion": ("FusedLion", "FusedLionBuilder")}
"""DeepSpeed's names whose (non-offloaded) optimizer is a fused kernel: (class, op builder)."""

MUP = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}

STATE_ELEMENTS = {
    "FusedAdam": 2,
    "DeepSpeedCPUAdam": 2,
    "DeepSpeedCPUAdagrad": 1,
    "DeepSpeedCPULion": 2,
    "FusedLion": 1,
    "FusedLamb": 2,
}
"""fp32 state elements per parameter of DeepSpeed's own optimizers (which a trial step would
build an op for), read from their `step`s: Adam's exp_avg and exp_avg_sq; CPU Adagrad's
exp_avg_sq; CPU Lion allocates an exp_avg_sq it never uses beside its exp_avg (DeepSpeed 0.19.8)."""


def type_name(kind: str) -> str:
    """`optimizer.type` as DeepSpeed reads it: its own names lower-cased, others as written."""
    return kind.lower() if kind.lower() in deepspeed_api.deepspeed_optimizer_names() else kind


def optimizer_class(kind: str, offload: bool, params: dict | None = None) -> type | None:
    """The class DeepSpeed's engine builds for `optimizer.type` `kind` with `params` (`offload`:
    the optimizer is offloaded), or None: Muon, a mup optimizer without mup, or a name DeepSpeed
    cannot build (torch.optim has no such optimizer class)."""
    name = type_name(kind)
    if name in ("adam", "adamw"):
        if (params or {}).get("torch_adam"):  # "adam" is AdamW too, unless adam_w_mode is false
            adam_w = name == "adamw" or (params or {}).get("adam_w_mode", True)
            return torch.optim.AdamW if adam_w else torch.optim.Adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return DeepSpeedCPUAdam if offload else FusedAdam
    if name == "adagrad" and offload:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad
    if name == "adagrad":
        return torch.optim.Adagrad
    if name == "lion":
        from deepspeed.ops import lion

        return lion.DeepSpeedCPULion if offload else lion.FusedLion
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb
    if name in MUP:
        return getattr(_mup(), MUP[name], None)
    if name == "muon":  # MuonWithAuxAdam: importing it compiles Muon's kernels (seconds)
        return None
    cls = getattr(torch.optim, name, None)
    is_optimizer = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
    return cls if is_optimizer and cls is not torch.optim.Optimizer else None


def _mup() -> Any:
    if importlib.util.find_spec("mup") is None:
        return None
    import mup

    return mup


def torch_names() -> list[str]:
    """The optimizer classes of torch.optim (what any other `optimizer.type` must name)."""
    names = [name for name in dir(torch.optim) if not name.startswith("_")]
    return sorted(n for n in names if optimizer_class(n, False) is getattr(torch.optim, n))


def missing_kernel(kind: str, offload: bool) -> tuple[str, str] | None:
    """(class, DeepSpeed's error) when `kind` needs a fused kernel this machine's accelerator
    lacks (its op builder is DeepSpeed's "not implemented" one, whose load raises at once)."""
    name = type_name(kind)
    if name not in KERNELS or (name == "lion" and offload):
        return None
    cls, builder_name = KERNELS[name]
    problem = deepspeed_api.op_problem(builder_name)
    return None if problem is None else (cls, problem)


def zero_tested(cls: type) -> bool:
    """Whether DeepSpeed runs `cls` under ZeRO without `zero_allow_untested_optimizer`."""
    return cls in deepspeed_api.zero_supported_optimizers()


def trial_problem(cls: type, params: dict[str, Any], offload: bool) -> str | None:
    """What torch says when `cls` (a torch.optim class) is built with `params` and steps twice on
    a small parameter on the device it will step on (the CPU when `offload`), as the engine
    builds and steps it; None when it runs."""
    from deepspeed.accelerator import get_accelerator

    device = "cpu" if offload else get_accelerator().device_name()
    param = torch.nn.Parameter(torch.ones(2, 2, device=device))
    try:
        opt = cls([param], **params)
        for _ in range(2):
            param.grad = torch.full_like(param, 0.5)
            opt.step()
    except (ValueError, TypeError, RuntimeError, AssertionError, KeyError) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


def state_bytes(section: dict[str, Any], offload: bool) -> tuple[str, int]:
    """(the class DeepSpeed builds for the optimizer `section`, the fp32 bytes of state it keeps
    per parameter): DeepSpeed's own from STATE_ELEMENTS; a torch.optim class's counted from its
    state after one step on a small parameter (so SGD without momentum keeps none, RMSprop with
    momentum and centered three elements)."""
    params = dict(section.get("params") or {})
    cls = optimizer_class(section["type"], offload, params)
    if cls is None:
        raise ValueError(f"DeepSpeed builds no optimizer this machine runs for {section['type']}")
    if cls.__name__ in STATE_ELEMENTS:
        return cls.__name__, 4 * STATE_ELEMENTS[cls.__name__]
    for key in ("torch_adam", "adam_w_mode", "fp32_optimizer_states"):  # DeepSpeed takes these
        params.pop(key, None)
    param = torch.nn.Parameter(torch.ones(2, 2))
    opt = cls([param], **params)
    param.grad = torch.full_like(param, 0.5)
    opt.step()
    elements = sum(
        v.numel() for v in opt.state[param].values() if torch.is_tensor(v) and v.dim() > 0
    )
    return cls.__name__, 4 * elements // param.numel()
