"""A stage's training state as full tensors by parameter name, out of and into DeepSpeed.

Saved per parameter: the fp32 master value and each per-element optimizer state tensor (Adam's
exp_avg and exp_avg_sq, SGD's momentum_buffer, Adagrad's sum, RMSprop's square_avg, Lion's
exp_avg, ...: whatever the optimizer keeps in the parameter's shape), whole — gathered over the
data-parallel group by DeepSpeed's own accessors (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`; ZeRO 1-3 and the bf16 optimizer) and joined over the
tensor-parallel group (`Shard.combine`). Loading does the reverse on any layout: each rank cuts
its tensor-parallel shard and hands the full value to DeepSpeed's `safe_set_full_*`, which keeps
this rank's ZeRO partition. Parameter names carry the global layer index, so pipeline stages
can be cut differently on load.

Two DeepSpeed details (0.19.8) need care (state saved at pp=2 x dp=2 continues the
uninterrupted losses at dp=1, 2 and 4 only with both:
`tests/distributed/test_checkpoint_resume.py::test_resume_is_exact_and_reshapes`):
- The optimizer's state is created lazily at the first step; before loading into a fresh
  engine it is materialised here (zeros, then overwritten), and ZeRO 1/2 and the bf16 optimizer
  must then (re)link their per-parameter views of it (`_link_state_views`), also before saving.
- The fp32 master and the model's own (possibly ZeRO-3 partitioned, possibly bf16) parameter
  are separate copies: both are set, else the next forward would use stale weights.

The step count is saved once (`optimizer_step`); DeepSpeed's CPU optimizers count it in a Python
int, torch's in a tensor. DeepSpeedCPUAdagrad (Adagrad offloaded) calls torch Adagrad's `sum`
`exp_avg_sq`: checkpoints use torch's name, so Adagrad resumes across offload on and off. NAdam
also keeps a scalar per parameter, `mu_product` (its momentum schedule multiplied over the
steps): it is replayed from the step count and the group's beta1 and momentum_decay, in float32
as NAdam's step multiplies it (bit for bit; the JSON check refuses OneCycle's momentum cycling
with NAdam, which changes beta1 every step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.lion import DeepSpeedCPULion
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import nn

COUNTS_IN_INT = (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)
"""DeepSpeed's CPU optimizers: their state's "step" is a Python int (torch's: a float32 tensor)."""

OWN_NAMES: dict[type, dict[str, str]] = {DeepSpeedCPUAdagrad: {"sum": "exp_avg_sq"}}
"""Per optimizer class: a checkpoint's state name -> the name this class keeps it under."""

ToHost = Callable[[torch.Tensor], torch.Tensor]  # a full tensor -> its copy in host memory


def basic_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer holding the state (inside DeepSpeed's ZeRO/bf16 wrapper, if any)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _managed(param: nn.Parameter) -> bool:
    """Whether DeepSpeed keeps a separate fp32 master for `param` (ZeRO 1-3, bf16)."""
    # ZeRO 1/2 set `_hp_mapping` on every parameter (None where another rank owns all of it)
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def unmanaged_masters(engine) -> dict[int, torch.Tensor]:
    """id(model parameter) -> its fp32 master where DeepSpeed keeps one without ZeRO's mapping:
    bf16 at ZeRO-0 runs FP16_UnfusedOptimizer (parallel `fp16_groups` / `fp32_groups` lists).
    Elsewhere empty: at ZeRO-0 fp32 the parameter is its own master."""
    opt = engine.optimizer
    low, high = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
    if low is None or high is None:
        return {}
    return {id(p): m for ps, ms in zip(low, high, strict=True) for p, m in zip(ps, ms, strict=True)}


def _own(opt: torch.optim.Optimizer, key: str) -> str:
    """The name under which `opt` keeps the state a checkpoint calls `key`."""
    return OWN_NAMES.get(type(opt), {}).get(key, key)


def optim_keys(engine) -> list[str]:
    """Names of the per-element optimizer state tensors (exp_avg, exp_avg_sq, momentum_buffer,
    ...), as checkpoints name them; none for an optimizer without such state (SGD without
    momentum)."""
    opt = basic_optimizer(engine)
    checkpoint_name = {own: key for key, own in OWN_NAMES.get(type(opt), {}).items()}
    for state in opt.state.values():
        return sorted(
            checkpoint_name.get(k, k)
            for k, v in state.items()
            if torch.is_tensor(v) and v.dim() > 0
        )
    return []


def optimizer_step(engine) -> int:
    """How many steps the optimizer has taken (Adam's bias correction depends on it; 0 for one
    that keeps no count, such as SGD)."""
    opt = basic_optimizer(engine)
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return int(opt.param_groups[0].get("step", 0))


def _join_tp(
    value: torch.Tensor,
    param: nn.Parameter,
    group: dist.ProcessGroup,
    device: torch.device,
    to_host: ToHost | None = None,
) -> torch.Tensor:
    """The full tensor of `param` from every rank's `value`, on the CPU: joined over the
    tensor-parallel `group`, or for an expert parameter (this rank's experts) over its
    expert-parallel group. The gather runs on `device`, the engine's: an NCCL group takes device
    tensors only, and an offloaded master or optimizer state lives on the CPU. `to_host` moves
    the full tensor instead of `.cpu()` (an asynchronous save's copy: never the live tensor)."""
    shard = getattr(param, "tp_shard", None)
    if shard is None:
        return value.cpu() if to_host is None else to_host(value)
    experts = getattr(param, "expert_parallel", None)
    group = experts.group if experts is not None else group
    value = value.to(device).contiguous()
    parts = [torch.empty_like(value) for _ in range(shard.size)]
    dist.all_gather(parts, value, group=group)
    if to_host is not None:
        return to_host(shard.combine(parts))
    return shard.combine([part.cpu() for part in parts])


def full_state(
    engine,
    module: nn.Module,
    keys: list[str],
    tp_group: dist.ProcessGroup,
    to_host: ToHost | None = None,
) -> Iterator[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]:
    """(name, full fp32 value, {key: full optimizer state}) for every parameter of `module`, on
    the CPU (`.cpu()`, which is the live tensor where it already lives there, or `to_host`).

    Collective: every rank of the stage (data- and tensor-parallel peers) must iterate it to the
    end, in step.
    """
    opt = basic_optimizer(engine)
    _link_state_views(engine)
    masters = unmanaged_masters(engine)
    for name, param in module.named_parameters():
        if _managed(param):
            value = safe_get_full_fp32_param(param)
            states = {k: safe_get_full_optimizer_state(param, _own(opt, k)) for k in keys}
        else:  # ZeRO-0: the optimizer's state is keyed by the master (maybe the param itself)
            master = masters.get(id(param), param)
            value = master.detach()
            states = {k: opt.state[master][_own(opt, k)] for k in keys}
        value = _join_tp(value.float(), param, tp_group, engine.device, to_host)
        states = {
            k: _join_tp(v.float(), param, tp_group, engine.device, to_host)
            for k, v in states.items()
        }
        yield name, value, states


def materialise_optimizer_state(engine, keys: list[str], step: int) -> None:
    """Give a fresh engine's optimizer the state entries loading will overwrite, at `step`
    (DeepSpeed's CPU optimizers count in a Python int, as they do themselves; torch's in a
    tensor), and the scalar state an optimizer derives from the step (NAdam's mu_product)."""
    opt = basic_optimizer(engine)
    counts_in_int = isinstance(opt, COUNTS_IN_INT)
    for group in opt.param_groups:
        if "step" in group:  # optimizers that count per group (DeepSpeed's FusedAdam)
            group["step"] = step
    for p, group in _params_and_groups(engine, opt):
        with _nvme_swapped_in(engine.optimizer, p):
            state = opt.state[p]
            for key in keys:
                if _own(opt, key) not in state:
                    state[_own(opt, key)] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = (
                step if counts_in_int else torch.tensor(float(step), dtype=torch.float32)
            )
            if isinstance(opt, torch.optim.NAdam):
                state["mu_product"] = _nadam_mu_product(group, step)
    _link_state_views(engine)


@contextlib.contextmanager
def _nvme_swapped_in(zero, flat: torch.Tensor) -> Iterator[None]:
    """ZeRO-3 with the optimizer offloaded to NVMe: a sub-group's fp32 partition `flat` and its
    state read in for the block, written back after it. Swapped out, `flat` is an empty tensor:
    state made from it would be empty, and DeepSpeed's swapper then never writes it
    (`safe_set_full_optimizer_state` failed on the size-0 state; z3-nvme of
    `tests/distributed/test_offload.py` resumes through this). Elsewhere nothing. (DeepSpeed's
    private methods, the ones its step uses: no public one exists.)"""
    flats = getattr(zero, "fp32_partitioned_groups_flat", [])
    i = next((i for i, f in enumerate(flats) if f is flat), None)
    if (
        i is None
        or not getattr(zero, "swap_optimizer", False)
        or not zero._swappable_optimizer_subgroup(i)
    ):
        yield
        return
    zero._optimizer_states_and_gradient_swap_in(i)
    try:
        yield
    finally:  # written back even when the block fails, as DeepSpeed's step would leave it
        zero._optimizer_states_and_gradient_swap_out(i)


def _params_and_groups(engine, opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """(parameter, its group) for everything the optimizer steps. ZeRO-3 puts its flat fp32
    partitions into the optimizer's groups only around each step: those are paired through
    `sub_group_to_group_id`."""
    pairs = [(p, group) for group in opt.param_groups for p in group["params"]]
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    to_group = getattr(engine.optimizer, "sub_group_to_group_id", {})
    pairs += [(flat, opt.param_groups[to_group.get(i, 0)]) for i, flat in enumerate(flats)]
    return pairs


def _nadam_mu_product(group: dict, step: int) -> torch.Tensor:
    """NAdam's mu_product after `step` steps: its momentum schedule mu_t multiplied into a float32
    one, in order, with the same Python-float factors its step computes (torch.optim.nadam)."""
    beta1, decay = group["betas"][0], group["momentum_decay"]
    product = torch.tensor(1.0, dtype=torch.float32)
    for t in range(1, step + 1):
        product *= beta1 * (1.0 - 0.5 * (0.96 ** (float(t) * decay)))
    return product


def _link_state_views(engine) -> None:
    """ZeRO 1/2 and the bf16 optimizer reach a parameter's optimizer state through views into
    the flat state, made once (`_lazy_init_hp_params_optimizer_state`). In DeepSpeed 0.19.8, after
    training steps they can still be empty (made before Adam created its state), so dsnd remakes
    them before reading or writing state. (A private DeepSpeed method: no public one exists.)"""
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def set_full_state(
    engine,
    param: nn.Parameter,
    value: torch.Tensor,
    states: dict[str, torch.Tensor],
    masters: dict[int, torch.Tensor],
) -> None:
    """Set `param` (this rank's tensor- or expert-parallel shard, full over data parallel)
    everywhere DeepSpeed keeps it: the model's parameter, the fp32 master, the optimizer state.
    `masters` is `unmanaged_masters(engine)`."""
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.data.copy_(value.to(device=param.device, dtype=param.dtype))  # ZeRO-3: re-sharded
    device = engine.device
    if _managed(param):
        safe_set_full_fp32_param(param, value.to(device))
        for key, v in states.items():
            safe_set_full_optimizer_state(param, v.to(device), _own(basic_optimizer(engine), key))
    else:
        master = masters.get(id(param), param)
        if master is not param:
            with torch.no_grad():
                master.copy_(value.to(device=master.device, dtype=master.dtype))
        opt = basic_optimizer(engine)
        for key, v in states.items():
            own = opt.state[master][_own(opt, key)]
            own.copy_(v.to(own.device))
