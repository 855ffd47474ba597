"""The JSON check's optimizers and schedulers: what DeepSpeed builds and runs here is accepted
(parameters checked against the real constructor), the rest refused by name with the reason
measured on this CPU; every DeepSpeed scheduler passes the check and steps."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.engine import deepspeed_api, optimizers
from dsnd.engine.compat import quiet_scheduler_start
from dsnd.engine.state import _nadam_mu_product
from dsnd.errors import UserError
from dsnd.plan.memory import model_state_bytes

UNTESTED = "ds.zero_allow_untested_optimizer=true"
OFFLOAD = 'ds.zero_optimization.offload_optimizer={"device": "cpu"}'
KERNEL = "which this device lacks (DeepSpeed: This op had not been implemented on CPU backend.)"
# every optimizer torch.optim has and DeepSpeed would build from the name, with what dsnd does
TORCH_ACCEPTED = ("SGD", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "Rprop")
TORCH_REFUSED = ("LBFGS", "SparseAdam", "ASGD", "Adafactor")


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _sets(kind: str, stage: int = 0, *more: str, **params) -> list[str]:
    section = {"type": kind, "params": {"lr": 0.01, **params}}
    return [f"ds.optimizer={json.dumps(section)}", f"ds.zero_optimization.stage={stage}", *more]


def _error(sets: list[str]) -> str:
    with pytest.raises(UserError) as e:
        load(None, sets)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_every_torch_optimizer_is_accepted_or_refused_by_name():
    assert set(optimizers.torch_names()) - {"Adam", "AdamW", "Muon"} == {
        *TORCH_ACCEPTED,
        *TORCH_REFUSED,
    }


@pytest.mark.parametrize("kind", TORCH_ACCEPTED)
def test_torch_optimizers_run_at_zero_0_and_with_the_untested_flag(kind):
    assert load(None, _sets(kind)).ds["optimizer"]["type"] == kind
    if kind != "Adagrad":  # torch's Adagrad is refused at ZeRO 1-3 (below)
        assert load(None, _sets(kind, 2, UNTESTED)).ds["optimizer"]["type"] == kind
        assert load(None, _sets(kind, 1, UNTESTED, OFFLOAD)).ds["optimizer"]["type"] == kind


@pytest.mark.parametrize("kind", [k for k in TORCH_ACCEPTED if k != "Adagrad"])
def test_zero_refuses_an_untested_optimizer_as_deepspeed_does(kind):
    msg = _error(_sets(kind, 1))
    assert f"'{kind}' (torch.optim.{kind}) at zero_optimization.stage 1 needs " in msg
    assert "(DeepSpeed: You are using an untested ZeRO Optimizer. Please add " in msg


@pytest.mark.parametrize("kind", TORCH_ACCEPTED)
def test_every_constructor_parameter_is_accepted_and_no_other(kind):
    cls = getattr(torch.optim, kind)
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or param.default in (None, inspect.Parameter.empty):
            continue
        value = list(param.default) if isinstance(param.default, tuple) else param.default
        if name in ("capturable", "differentiable"):  # torch refuses True on the CPU; False is fine
            value = False
        assert load(None, _sets(kind, **{name: value})).ds["optimizer"]["params"][name] == value
    assert "optimizer.params: unknown key 'betaz'" in _error(_sets(kind, betaz=[0.9, 0.99]))


def test_deepspeeds_cpu_optimizers_take_their_own_parameters():
    ds = load(None, _sets("Adagrad", 3, OFFLOAD, eps=1e-8, fp32_optimizer_states=True)).ds
    assert ds["optimizer"]["params"]["eps"] == 1e-8
    # torch's Adagrad has lr_decay; DeepSpeedCPUAdagrad, which offload builds, has not
    assert "unknown key 'lr_decay'" in _error(_sets("Adagrad", 3, OFFLOAD, lr_decay=0.1))
    ds = load(None, _sets("Lion", 1, OFFLOAD, betas=[0.9, 0.99], weight_decay=0.1)).ds
    assert ds["optimizer"]["type"] == "Lion"
    assert "betas must each be in [0, 1), got [0.9, 1.5]" in _error(
        _sets("Lion", 1, OFFLOAD, betas=[0.9, 1.5])
    )


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        ("SGD", {"momentum": "0.9"}, "optimizer.params.momentum must be a number, got '0.9'"),
        ("SGD", {"nesterov": 1}, "optimizer.params.nesterov must be bool, got 1"),
        ("SGD", {"foreach": 1}, "optimizer.params.foreach must be bool or null, got 1"),
        ("Rprop", {"etas": [0.5]}, "optimizer.params.etas must be a list of 2 numbers, got [0.5]"),
        (
            "SGD",
            {"lr": -1},
            "optimizer.params: torch.optim.SGD refuses them: Invalid learning rate: -1",
        ),
        (
            "SGD",
            {"nesterov": True},
            "torch.optim.SGD refuses them: Nesterov momentum requires a "
            "momentum and zero dampening",
        ),
        (
            "RMSprop",
            {"capturable": True},
            "torch.optim.RMSprop refuses them: If capturable=True, "
            "params and state_steps must be on supported devices",
        ),
        (
            "SGD",
            {"max_grad_norm": 1.0},
            "optimizer.params: 'max_grad_norm' is refused: DeepSpeed "
            "refuses it as an optimizer parameter; use the top-level gradient_clipping",
        ),
    ],
)
def test_parameters_are_checked_by_type_and_by_torch(kind, params, message):
    assert message in _error(_sets(kind, **params))


@pytest.mark.parametrize(
    ("kind", "sets", "message"),
    [
        ("Lamb", (), f"optimizer.type 'Lamb' needs DeepSpeed's FusedLamb CUDA kernel, {KERNEL}"),
        (
            "Lion",
            (),
            f"optimizer.type 'Lion' needs DeepSpeed's FusedLion CUDA kernel, {KERNEL} "
            "(with zero_optimization.offload_optimizer.device 'cpu' DeepSpeed builds "
            "DeepSpeedCPULion, which runs here)",
        ),
        (
            "MuAdam",
            (),
            "optimizer.type 'MuAdam' needs the mup package, which is not installed "
            "(DeepSpeed: cannot access local variable 'MuAdam' where it is not associated with a "
            "value)",
        ),
        ("musgd", (), "optimizer.type 'musgd' needs the mup package"),
        ("MuAdamW", (), "optimizer.type 'MuAdamW' needs the mup package"),
        ("Muon", (), "optimizer.type 'Muon' is refused: it is not supported by dsnd yet"),
        ("LBFGS", (), "optimizer.type 'LBFGS' is refused: its step needs a closure"),
        (
            "SparseAdam",
            (),
            "is refused: it needs sparse gradients (torch: SparseAdam does not "
            "support dense gradients",
        ),
        ("ASGD", (), "optimizer.type 'ASGD' is refused: its per-parameter eta and mu"),
        ("Adafactor", (), "optimizer.type 'Adafactor' is refused: ZeRO's flat partitions change"),
        (
            "Adagrad",
            ("ds.zero_optimization.stage=2",),
            "optimizer.type 'Adagrad' "
            "(torch.optim.Adagrad) at zero_optimization.stage 2 is refused: DeepSpeed's ZeRO 1-3 "
            "rebuild it as one parameter group",
        ),
        (
            "sgd",
            (),
            "optimizer.type 'sgd' is neither one of DeepSpeed's optimizers nor a "
            "torch.optim optimizer (did you mean 'SGD'?)",
        ),
        ("Optimizer", (), "optimizer.type 'Optimizer' is neither one of DeepSpeed's optimizers"),
        (
            "NAdam",
            (
                'ds.scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.001, '
                '"cycle_max_lr": 0.01}}',
            ),
            "optimizer.type 'NAdam' with scheduler OneCycle needs scheduler.params.cycle_momentum "
            "false",
        ),
    ],
)
def test_refused_by_name_with_the_reason(kind, sets, message):
    section = json.dumps({"type": kind, "params": {"lr": 0.01}})
    assert message in _error([f"ds.optimizer={section}", *sets])


def test_the_kernel_refusals_are_what_deepspeed_raises_here():
    assert deepspeed_api.op_problem("FusedLambBuilder") == (
        "This op had not been implemented on CPU backend."
    )
    assert deepspeed_api.op_problem("CPULionBuilder") is None  # DeepSpeedCPULion's op exists


def test_nadam_with_onecycle_without_momentum_cycling_is_accepted():
    sched = {
        "type": "OneCycle",
        "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_momentum": False},
    }
    ds = load(None, [*_sets("NAdam"), f"ds.scheduler={json.dumps(sched)}"]).ds
    assert ds["scheduler"]["params"]["cycle_momentum"] is False


def test_nadams_mu_product_is_replayed_bit_for_bit():
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.NAdam([param], betas=(0.9, 0.95), momentum_decay=0.004)
    for step in range(1, 12):
        param.grad = torch.full_like(param, 0.1 * step)
        opt.step()
        want = opt.state[param]["mu_product"]
        assert _nadam_mu_product(opt.param_groups[0], step).item() == want.item(), step
    assert _nadam_mu_product(opt.param_groups[0], 0).item() == 1.0


@pytest.mark.parametrize(
    ("section", "offload", "built", "nbytes"),
    [
        ({"type": "AdamW", "params": {"torch_adam": True}}, False, "AdamW", 8),
        ({"type": "Adam", "params": {"torch_adam": True, "amsgrad": True}}, False, "AdamW", 12),
        ({"type": "Adam", "params": {}}, False, "FusedAdam", 8),
        ({"type": "AdamW", "params": {}}, True, "DeepSpeedCPUAdam", 8),
        ({"type": "SGD", "params": {"lr": 0.1}}, False, "SGD", 0),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, False, "SGD", 4),
        ({"type": "RMSprop", "params": {"momentum": 0.9, "centered": True}}, False, "RMSprop", 12),
        ({"type": "Adagrad", "params": {}}, False, "Adagrad", 4),
        ({"type": "Adagrad", "params": {}}, True, "DeepSpeedCPUAdagrad", 4),
        ({"type": "Lion", "params": {}}, True, "DeepSpeedCPULion", 8),
        ({"type": "Rprop", "params": {}}, False, "Rprop", 8),
    ],
)
def test_optimizer_state_bytes_per_parameter(section, offload, built, nbytes):
    assert optimizers.state_bytes(section, offload) == (built, nbytes)


def test_the_memory_formula_takes_the_optimizers_state():
    adam = model_state_bytes(1, 100, 2, bf16=False)
    sgd = model_state_bytes(1, 100, 2, bf16=False, state_bytes=0)
    assert adam["device"]["optimizer"] == 400 and sgd["device"]["optimizer"] == 0
    assert {k: v for k, v in sgd["device"].items() if k != "optimizer"} == {
        k: v for k, v in adam["device"].items() if k != "optimizer"
    }
    lion = model_state_bytes(3, 100, 2, bf16=True, offload_optimizer=True, state_bytes=8)
    assert lion["cpu"] == {"master": 200.0, "optimizer": 400.0}


SCHEDULERS = {
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
    "OneCycle": {
        "cycle_min_lr": 0.0001,
        "cycle_max_lr": 0.001,
        "cycle_first_step_size": 2,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
    },
    "WarmupLR": {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 2,
        "warmup_type": "linear",
    },
    "WarmupDecayLR": {
        "warmup_min_lr": 0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 2,
        "total_num_steps": "auto",
        "warmup_type": "linear",
    },
    "WarmupCosineLR": {
        "total_num_steps": "auto",
        "warmup_num_steps": 2,
        "warmup_min_ratio": 0.0,
        "cos_min_ratio": 0.1,
        "warmup_type": "linear",
    },
}
# the lr each of steps 1..6 uses (train.steps 6, the optimizer's lr 0.003), as DeepSpeed 0.19.8's
# classes give it (measured): a warmup holds warmup_min_lr for two steps (the first is set when
# the class is built, the second by its first step(), both at iteration 0); WarmupCosineLR
# scales the optimizer's own lr
LRS = {
    "LRRangeTest": [0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035],
    "OneCycle": [0.0001, 0.00055, 0.001, 0.00055, 0.0001, 0.0001],
    "WarmupLR": [0.0, 0.0, 0.0005, 0.001, 0.001, 0.001],
    "WarmupDecayLR": [0.0, 0.0, 0.0005, 0.001, 0.00075, 0.0005],
    "WarmupCosineLR": [0.0, 0.0, 0.0015, 0.0026046, 0.00165, 0.0006954],
}


def test_the_schedulers_are_deepspeeds_list():
    assert set(SCHEDULERS) == set(deepspeed_api.lr_schedules().VALID_LR_SCHEDULES)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_every_deepspeed_scheduler_passes_the_check_and_steps(kind, optimizer):
    section = json.dumps({"type": kind, "params": SCHEDULERS[kind]})
    sets = ["train.steps=6", f"ds.scheduler={section}"]
    if optimizer == "SGD":
        sets += _sets("SGD", momentum=0.9, lr=0.003)
    ds = resolve(load(None, sets), 1).ds  # "auto": total_num_steps = train.steps
    params = ds["scheduler"]["params"]
    assert "auto" not in params.values() and params.get("total_num_steps", 6) == 6
    model = torch.nn.Linear(2, 2)
    opt_params = {k: v for k, v in ds["optimizer"]["params"].items() if k != "torch_adam"}
    opt = getattr(torch.optim, optimizer)(model.parameters(), **opt_params)
    sched = getattr(deepspeed_api.lr_schedules(), kind)(opt, **params)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    assert lrs == pytest.approx(LRS[kind], abs=1e-6), kind
    if kind == "OneCycle" and optimizer == "AdamW":  # it cycles beta1 where there are betas
        assert opt.param_groups[0]["betas"][0] != ds["optimizer"]["params"]["betas"][0]


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_a_warmup_scheduler_built_for_an_engine_warms_nobody(kind, caplog):
    """DeepSpeed's warmup classes warn "Attempting to get learning rate from scheduler before it
    has started" from their own constructor, on every rank of every run: the engine is built
    quietly; a later such warning would still show."""
    params = {k: 6 if v == "auto" else v for k, v in SCHEDULERS[kind].items()}
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.003)
    schedules = deepspeed_api.lr_schedules()

    def warned() -> bool:
        said = any("before it has started" in r.getMessage() for r in caplog.records)
        caplog.clear()
        return said

    getattr(schedules, kind)(opt, **params)
    assert warned()  # what DeepSpeed says unasked
    with quiet_scheduler_start():
        sched = getattr(schedules, kind)(opt, **params)
    assert not warned()
    sched.last_batch_iteration = -1
    sched.get_lr()  # asked outside the engine's construction: still said
    assert warned()


def test_a_torch_scheduler_deepspeed_would_build_is_refused_by_name():
    with pytest.raises(
        UserError,
        match=r"scheduler.type 'StepLR' \(a torch.optim.lr_scheduler "
        r"class, which DeepSpeed also builds by name\) is not "
        r"supported by dsnd yet",
    ):
        load(None, ['ds.scheduler={"type": "StepLR", "params": {"step_size": 2}}'])
    with pytest.raises(
        UserError,
        match=r"'WarmupLr' is not a DeepSpeed scheduler \(did you "
        r"mean 'WarmupLR'\?\)",
    ):
        load(None, ['ds.scheduler={"type": "WarmupLr", "params": {}}'])
