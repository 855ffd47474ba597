"""The JSON's `optimizer` and `scheduler` sections: the optimizer DeepSpeed's engine builds and
whether it runs here (`dsnd.engine.optimizers`), its parameters by that class's constructor;
DeepSpeed's schedulers by theirs. Every problem is a one-line UserError before start."""

from __future__ import annotations

import inspect
from typing import Any

from dsnd.config.ds_checks import check_param_type, check_section_keys, is_number, type_and_params
from dsnd.engine import deepspeed_api, optimizers, public
from dsnd.errors import UserError, did_you_mean

OPTIMIZERS = {"adam", "adamw"}
"""DeepSpeed's Adam names, checked against OPTIMIZER_PARAMS (the engine takes `torch_adam` and
`adam_w_mode` out before it builds FusedAdam, DeepSpeedCPUAdam or torch's Adam(W)). Every other
optimizer DeepSpeed builds (dsnd.engine.optimizers) is checked against its class's constructor,
unless refused by name below or for a kernel this device lacks."""
OPTIMIZER_PARAMS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "torch_adam",
    "adam_w_mode",
    "bias_correction",
    "foreach",
    "fused",
    "maximize",
    "capturable",
    "differentiable",
}
_NUMBER_PARAMS = {"lr", "eps", "weight_decay"}
_BOOL_PARAMS = OPTIMIZER_PARAMS - _NUMBER_PARAMS - {"betas"}

REFUSED_OPTIMIZERS = {
    "LBFGS": "its step needs a closure that re-evaluates the loss, which DeepSpeed's engine "
    "never passes (torch: LBFGS.step() missing 1 required positional argument: 'closure')",
    "SparseAdam": "it needs sparse gradients (torch: SparseAdam does not support dense "
    "gradients, please consider Adam instead)",
    "ASGD": "its per-parameter eta and mu depend on the learning rates of past steps, and dsnd's "
    "checkpoints keep per-element optimizer state and the step count only (a resumed run would "
    "differ)",
    "Adafactor": "ZeRO's flat partitions change its math (measured: a matrix's second moment is "
    "factored into row_var and col_var at ZeRO-0, kept whole over the flat partition at ZeRO "
    "1-3), and factored state is not per element, which dsnd's layout-free checkpoints need",
    "muon": "it is not supported by dsnd yet: DeepSpeed's MuonWithAuxAdam keeps momentum_buffer "
    "for matrices and Adam's state for the other parameters, which dsnd's checkpoints do not "
    "save apart (measured at pp=2 x dp=2: ZeRO-0 trains, then saving fails with KeyError "
    "'momentum_buffer'; ZeRO-1 never finished its first step), and tensor parallelism would "
    "orthogonalise shards, not whole matrices",
}
"""Optimizers DeepSpeed builds that cannot train in dsnd, by the name DeepSpeed reads
(`optimizers.type_name`), with the reason (found on a CPU with DeepSpeed 0.19.8 and torch 2.13;
`tests/unit/test_ds_optimizers.py` checks the refusals, not the failures behind them)."""

DEVICE_FLAGS = ("capturable", "fused")
"""torch.optim parameters whose validity depends on the device the optimizer steps on
(capturable: CUDA and a few others, not the CPU; fused Adagrad: the CPU only)."""


def trial_params(params: dict[str, Any], step_device: str) -> dict[str, Any]:
    """The parameters a config check's trial step takes: the trial runs on CPU tensors whatever
    the device the engine will step on (`step_device`), so that checking a config on a GPU
    machine opens no CUDA context — every rank checks its config before it binds its GPU, and
    a trial there would put a context on GPU 0 from every rank. For another device the flags
    whose answer depends on the device (DEVICE_FLAGS) are left to torch at the engine's build."""
    if step_device == "cpu":
        return dict(params)
    return {k: v for k, v in params.items() if k not in DEVICE_FLAGS}


REFUSED_OPTIMIZER_PARAMS = {
    "max_grad_norm": "DeepSpeed refuses it as an optimizer parameter; use the top-level "
    "gradient_clipping",
}


def check_optimizer(opt: Any, path: str, ds: dict[str, Any] | None = None) -> None:
    """The optimizer section of `ds`: the type DeepSpeed builds and can run here, its
    parameters by the constructor DeepSpeed calls, and ZeRO's untested-optimizer rule."""
    section = type_and_params(opt, "optimizer", path)
    if section is None:
        return
    kind, params = section
    if kind.lower() in OPTIMIZERS:
        _check_adam(params, path)
        return
    zero = (ds or {}).get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage") if zero.get("stage") in (1, 2, 3) else 0
    offload = zero.get("offload_optimizer")
    offload = stage > 0 and isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")
    cls = _optimizer_class(kind, offload, path)
    where = f"{path}: optimizer.params"
    signature = inspect.signature(cls.__init__).parameters
    known = set(signature) - {"self", "params", "model_params"}
    check_section_keys(params, known, REFUSED_OPTIMIZER_PARAMS, where)
    for key, value in params.items():
        _check_optimizer_param(where, key, value, signature[key])
    if cls.__module__.startswith("torch.optim"):  # torch checks its own ranges: let it
        step_device = "cpu" if offload else public.accelerator().device_name()
        # offload=True: the trial steps on the CPU (see `trial_params`)
        problem = optimizers.trial_problem(cls, trial_params(params, step_device), offload=True)
        if problem:
            raise UserError(f"{where}: {_class_name(cls)} refuses them: {problem}")
    else:
        _check_adam_ranges(params, path)
    if cls.__name__ == "Adagrad" and cls.__module__.startswith("torch.optim") and stage:
        raise UserError(
            f"{path}: optimizer.type '{kind}' (torch.optim.Adagrad) at zero_optimization.stage "
            f"{stage} is refused: DeepSpeed's ZeRO 1-3 rebuild it as one parameter group over "
            "their flat partitions, which fails with dsnd's two (no weight decay on norms, "
            "biases and embeddings; measured: IndexError: list index out of range, at the first "
            "step); use ZeRO-0, or offload_optimizer to the CPU (DeepSpeedCPUAdagrad)"
        )
    allowed = (ds or {}).get("zero_allow_untested_optimizer")
    if stage and not optimizers.zero_tested(cls) and not allowed:
        raise UserError(
            f"{path}: optimizer.type '{kind}' ({_class_name(cls)}) at zero_optimization.stage "
            f'{stage} needs "zero_allow_untested_optimizer": true (DeepSpeed: You are using an '
            'untested ZeRO Optimizer. Please add <"zero_allow_untested_optimizer": true> in the '
            "configuration file to use it.)"
        )
    sched = (ds or {}).get("scheduler")
    sched = sched if isinstance(sched, dict) else {}
    cycles = sched.get("type") == "OneCycle" and (sched.get("params") or {}).get(
        "cycle_momentum", True
    )
    if cls.__name__ == "NAdam" and cycles:
        raise UserError(
            f"{path}: optimizer.type '{kind}' with scheduler OneCycle needs "
            "scheduler.params.cycle_momentum false: OneCycle changes NAdam's beta1 every step, "
            "and a resumed NAdam replays its mu_product (beta1's schedule multiplied over the "
            "past steps) with one beta1"
        )


def _class_name(cls: type) -> str:
    return (
        f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
    )


def _optimizer_class(kind: str, offload: bool, path: str) -> type:
    """The class DeepSpeed builds for `kind`, or the UserError saying why it cannot run here."""
    name = optimizers.type_name(kind)
    refuse = f"{path}: optimizer.type '{kind}'"
    if name in REFUSED_OPTIMIZERS:
        raise UserError(f"{refuse} is refused: {REFUSED_OPTIMIZERS[name]}")
    missing = optimizers.missing_kernel(kind, offload)
    if missing:
        cls, error = missing
        also = (
            (
                " (with zero_optimization.offload_optimizer.device 'cpu' DeepSpeed builds "
                "DeepSpeedCPULion, which runs here)"
            )
            if name == "lion"
            else ""
        )
        raise UserError(
            f"{refuse} needs DeepSpeed's {cls} CUDA kernel, which this device lacks "
            f"(DeepSpeed: {error}){also}"
        )
    cls = optimizers.optimizer_class(kind, offload)
    if name in optimizers.MUP:
        raise UserError(
            f"{refuse} needs mup's base shapes on every parameter (mup.set_base_shapes), which "
            "dsnd's models do not carry"
            if cls
            else f"{refuse} needs the mup package, which is not installed (DeepSpeed: cannot "
            f"access local variable '{optimizers.MUP[name]}' where it is not associated with a "
            "value)"
        )
    if cls is None:
        names = optimizers.torch_names()
        by_case = [n for n in names if n.lower() == kind.lower()]
        hint = f" (did you mean '{by_case[0]}'?)" if by_case else did_you_mean(kind, names)
        raise UserError(
            f"{refuse} is neither one of DeepSpeed's optimizers nor a torch.optim optimizer{hint}"
        )
    return cls


def _check_optimizer_param(where: str, key: str, value: Any, param: inspect.Parameter) -> None:
    """`value` by the constructor's default: a number, bool, list of numbers (for a tuple), or
    bool or null (for a ``bool | None`` defaulting to None)."""
    default = param.default
    if isinstance(default, tuple):
        if not (
            isinstance(value, list) and len(value) == len(default) and all(map(is_number, value))
        ):
            raise UserError(
                f"{where}.{key} must be a list of {len(default)} numbers, got {value!r}"
            )
    elif default is None:
        if "bool" in str(param.annotation) and value is not None and not isinstance(value, bool):
            raise UserError(f"{where}.{key} must be bool or null, got {value!r}")
    elif default is not inspect.Parameter.empty:
        check_param_type(where, key, value, default)


def _check_adam(params: dict[str, Any], path: str) -> None:
    where = f"{path}: optimizer.params"
    check_section_keys(params, OPTIMIZER_PARAMS, REFUSED_OPTIMIZER_PARAMS, where)
    for key, value in params.items():
        if key in _NUMBER_PARAMS:
            check_param_type(f"{path}: optimizer.params", key, value, 0.0)
        elif key in _BOOL_PARAMS and value is not None and not isinstance(value, bool):
            raise UserError(f"{path}: optimizer.params.{key} must be bool, got {value!r}")
        elif key == "betas" and not (
            isinstance(value, list) and len(value) == 2 and all(map(is_number, value))
        ):
            raise UserError(f"{path}: optimizer.params.betas must be [beta1, beta2], got {value!r}")
    _check_adam_ranges(params, path)


def _check_adam_ranges(params: dict[str, Any], path: str) -> None:
    """torch's Adam refuses these too, but only when the engine builds it, after the process
    group has started (and DeepSpeed's CPU Adagrad and Lion do not check them at all)."""
    for key in sorted(_NUMBER_PARAMS & set(params)):
        if params[key] is not None and params[key] < 0:
            raise UserError(f"{path}: optimizer.params.{key} must be >= 0, got {params[key]}")
    betas = params.get("betas") or []
    if any(not 0 <= beta < 1 for beta in betas):
        raise UserError(f"{path}: optimizer.params.betas must each be in [0, 1), got {betas}")


def check_scheduler(sched: Any, path: str) -> None:
    section = type_and_params(sched, "scheduler", path)
    if section is None:
        return
    kind, params = section
    lr_schedules = deepspeed_api.lr_schedules()
    if kind not in lr_schedules.VALID_LR_SCHEDULES and _is_torch_scheduler(kind):
        raise UserError(
            f"{path}: scheduler.type '{kind}' (a torch.optim.lr_scheduler class, which DeepSpeed "
            "also builds by name) is not supported by dsnd yet: train.lr_scaling and the "
            "checkpointed schedule are wired for DeepSpeed's schedulers; use one of "
            f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}"
        )
    if kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise UserError(
            f"{path}: scheduler.type '{kind}' is not a DeepSpeed scheduler"
            + did_you_mean(kind, lr_schedules.VALID_LR_SCHEDULES)
            + f" (one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)})"
        )
    signature = inspect.signature(getattr(lr_schedules, kind).__init__).parameters
    known = set(signature) - {"self", "optimizer", "last_batch_iteration"}
    check_section_keys(params, known, {}, f"{path}: scheduler.params")
    for key in sorted(known):
        default = signature[key].default
        if key not in params:
            if default is inspect.Parameter.empty:
                raise UserError(f"{path}: scheduler.params.{key} is required by {kind}")
            continue
        # the default's type; a `*_lr` without one (required, or None = "the optimizer's") is a
        # number too, and train.lr_scaling multiplies it
        like = default if default not in (inspect.Parameter.empty, None) else None
        if like is None and (key.endswith("_lr") or default is inspect.Parameter.empty):
            like = 0.0  # every required parameter of DeepSpeed's schedules is a number
        if like is not None:
            check_param_type(f"{path}: scheduler.params", key, params[key], like)


def _is_torch_scheduler(kind: str) -> bool:
    import torch

    cls = getattr(torch.optim.lr_scheduler, kind, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)
