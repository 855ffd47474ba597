"""The learning rate a run trains at: the JSON's own numbers (an optimizer without a scheduler
runs at its lr, constant, as DeepSpeed runs it), train.lr / warmup_steps / lr_decay / min_lr
filling what the JSON leaves "auto" and refused where it says otherwise, the Hugging Face
Trainer's fine-tuning defaults with model.init_from, and every step's rate equal to DeepSpeed's
own scheduler class of the same name built from the JSON dsnd resolves."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from deepspeed.runtime import lr_schedules

from dsnd import cli
from dsnd.checkpoint.load import restore_schedule
from dsnd.config.load import load
from dsnd.config.lr_schedule import FINE_TUNE_LINE
from dsnd.config.resolve import Resolved, resolve
from dsnd.errors import UserError
from tests.models import spec_of
from tests.one_rank import one_rank_world

BATCH = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 0},
}
ADAMW_1E5 = {**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
"""The issue's JSON: an lr and no scheduler (DeepSpeed trains at 1e-5 throughout)."""
HF_AUTO = {
    **BATCH,
    "optimizer": {
        "type": "AdamW",
        "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
        | {"torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            k: "auto"
            for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
        },
    },
}
"""The Hugging Face Trainer's JSONs' "auto" optimizer and scheduler."""


def _resolved(tmp_path, ds: dict | None, *sets: str) -> Resolved:
    """`ds` (None: the packaged zero0.json) with `sets`, for one rank."""
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        sets = (f"deepspeed={tmp_path / 'ds.json'}", *sets)
    return resolve(load(None, list(sets)), 1)


def _fine_tune_dir(tmp_path) -> str:
    """A model directory for model.init_from (its config.json is what resolving reads)."""
    spec_of("llama-tiny").config.save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


def test_an_optimizer_without_a_scheduler_runs_at_its_lr_constant(tmp_path):
    res = _resolved(tmp_path, ADAMW_1E5)
    assert "scheduler" not in res.ds and res.ds["optimizer"]["params"]["lr"] == 1e-5
    assert (
        "scheduler: none in the JSON -> the optimizer's lr 1e-05, constant, as DeepSpeed "
        "runs it (train.warmup_steps, train.lr_decay or train.min_lr add a schedule)"
        in res.ds_notes
    )
    # a key asking for a schedule adds one, from the JSON's lr, with no warm-up unless asked
    res = _resolved(tmp_path, ADAMW_1E5, "train.lr_decay=cosine", "train.min_lr=1e-6")
    assert res.ds["scheduler"] == {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 20,
            "warmup_min_ratio": 1.0,
            "warmup_num_steps": 1,
            "cos_min_ratio": pytest.approx(0.1),
            "warmup_type": "linear",
        },
    }


def test_neither_section_is_the_runs_and_a_fine_tune_takes_the_trainers_defaults(tmp_path):
    res = _resolved(tmp_path, BATCH)  # from scratch: dsnd's AdamW and warm-up, as before
    assert res.ds["optimizer"]["params"] == {
        "lr": 0.003,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
    }
    assert res.ds["scheduler"] == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0003,
            "warmup_max_lr": 0.003,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
    }
    assert FINE_TUNE_LINE not in res.ds_notes
    hf = f"model.init_from={_fine_tune_dir(tmp_path)}"
    for ds in (BATCH, HF_AUTO, None):  # no sections, "auto" ones, the packaged JSON
        res = _resolved(tmp_path, ds, hf, "train.steps=12")
        assert {
            k: res.ds["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")
        } == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        assert res.ds["scheduler"]["type"] == "WarmupDecayLR"
        assert {
            k: res.ds["scheduler"]["params"][k]
            for k in ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps")
        } == {
            "total_num_steps": 12,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 5e-5,
            "warmup_num_steps": 1,
        }
        assert FINE_TUNE_LINE in res.ds_notes
    # a fine-tune's keys win over the Trainer's defaults; the rest stay the Trainer's
    res = _resolved(tmp_path, None, hf, "train.lr=2e-5", "train.warmup_steps=3")
    assert res.ds["scheduler"]["params"] == {
        "total_num_steps": 20,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 2e-5,
        "warmup_num_steps": 3,
        "warmup_type": "linear",
    }


def test_the_keys_fill_autos_as_the_trainers_arguments_do(tmp_path):
    sets = ("train.lr=2e-5", "train.warmup_steps=10", "train.min_lr=1e-6", "train.steps=50")
    res = _resolved(tmp_path, HF_AUTO, *sets)
    assert res.ds["optimizer"]["params"]["lr"] == 2e-5
    assert res.ds["scheduler"]["params"] == {
        "warmup_min_lr": 1e-6,
        "warmup_max_lr": 2e-5,
        "warmup_num_steps": 10,
        "total_num_steps": 50,
    }
    assert "scheduler.params.warmup_max_lr: 'auto' -> 2e-05 (train.lr)" in res.ds_notes
    # the packaged JSON leaves its scheduler's type to the run: train.lr_decay chooses it
    res = _resolved(tmp_path, None, "train.lr=1e-3", "train.lr_decay=cosine")
    assert res.ds["scheduler"]["type"] == "WarmupCosineLR"
    assert res.ds["optimizer"]["params"]["lr"] == 1e-3
    assert res.ds["scheduler"]["params"]["cos_min_ratio"] == 0.1  # dsnd's: a tenth of lr


@pytest.mark.parametrize(
    "ds, sets, message",
    [
        (
            ADAMW_1E5,
            ["train.lr=2e-5"],
            "{json}: optimizer.params.lr is 1e-05, and train.lr is 2e-05: "
            'set one of them ("auto" in the JSON takes the run\'s)',
        ),
        (
            {
                **HF_AUTO,
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {"warmup_num_steps": 100, "total_num_steps": 9},
                },
            },
            ["train.warmup_steps=10"],
            "{json}: scheduler.params.warmup_num_steps is 100, and "
            "train.warmup_steps is 10: set one of them",
        ),
        (
            HF_AUTO,
            ["train.lr_decay=cosine"],
            "{json}: scheduler.type is WarmupDecayLR, and "
            "train.lr_decay=cosine is WarmupCosineLR: set one of them",
        ),
        (
            {**HF_AUTO, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0}}},
            ["train.min_lr=1e-6"],
            "{json}: scheduler.params.warmup_min_lr is 0, and train.min_lr is "
            "1e-06: set one of them",
        ),
        (
            {
                **BATCH,
                "scheduler": {
                    "type": "OneCycle",
                    "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3},
                },
            },
            ["train.lr=1e-3"],
            "{json}: scheduler.type is OneCycle, which sets the learning rate by its "
            "own params; train.lr=0.001 applies to WarmupLR, WarmupDecayLR and WarmupCosineLR only",
        ),
        (
            None,
            ["train.lr=1e-4", "train.min_lr=1e-3"],
            "{json}: train.min_lr=0.001 is above the learning rate 0.0001 (train.lr)",
        ),
        (
            None,
            ["train.min_lr=1e-5", "train.warmup_steps=0"],
            "{json}: train.min_lr=1e-05 has no "
            "effect: the rate is constant (lr_decay constant) without a warm-up",
        ),
        (None, ["train.warmup_steps=-1"], "train.warmup_steps must be >= 0 (or null), got -1"),
    ],
)
def test_a_key_the_json_contradicts_is_refused_naming_both(tmp_path, ds, sets, message):
    path = str(tmp_path / "ds.json") if ds is not None else load(None).ds_path
    with pytest.raises(UserError) as e:
        _resolved(tmp_path, ds, *sets)
    assert str(e.value).startswith(message.format(json=path))


STEPS = 12
CASES = {  # name: (JSON, sets, the rate per step the keys mean: DeepSpeed's semantics, by hand)
    "no scheduler": (ADAMW_1E5, (), [1e-5] * STEPS),
    "dsnd's default": (None, (), [3e-4, 3e-4, 8.4e-4, 1.38e-3, 1.92e-3, 2.46e-3] + [3e-3] * 6),
    # the Trainer's defaults: DeepSpeed's WarmupDecayLR raises a 0 warm-up to 2 steps, from 0
    "fine-tune": (
        None,
        ("model.init_from",),
        [0.0, 0.0, 2.5e-5] + [5e-5 * (STEPS - it) / (STEPS - 2) for it in range(2, 11)],
    ),
    # WarmupCosineLR: step 1 at 0 (its constructor's ratio), the warm-up from min_lr / lr
    "cosine": (
        None,
        ("train.lr=1e-3", "train.lr_decay=cosine", "train.warmup_steps=2", "train.min_lr=1e-4"),
        [0.0, 1e-4, 5.5e-4]
        + [
            1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi * (it - 1) / (STEPS - 2))) / 2)
            for it in range(2, 11)
        ],
    ),
}


def _engine_rates(
    res: Resolved,
    steps: int,
    resume: tuple[dict | None, int] | None = None,
) -> tuple[list[float], dict | None]:
    """The rate each step of dsnd's engine (dsnd.engine.build, on the resolved JSON) trains at,
    as the trainer reports it, and the scheduler's state after them; `resume` (a scheduler
    state, its step): restored there first, as a checkpoint's load does."""
    from dsnd.engine.build import build_engine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine = build_engine(
        model, copy.deepcopy(res.ds), [{"params": list(model.parameters())}], None
    )
    if resume is not None:
        restore_schedule(engine.lr_scheduler, *resume)
    rates = []
    for _ in range(steps):
        rates.append(engine.optimizer.param_groups[0]["lr"])  # the rate this step will use
        for _ in range(res.batch.gas):  # the optimizer steps at the accumulation boundary
            engine.backward(engine(torch.ones(res.batch.micro, 4)).sum())
            engine.step()
    return rates, engine.lr_scheduler.state_dict() if engine.lr_scheduler else None


def _deepspeeds_rates(ds: dict, steps: int) -> list:
    """DeepSpeed's scheduler class of the JSON's name, on a torch optimizer, stepped as
    DeepSpeed's engine steps it (once per optimizer step); none: the optimizer's lr."""
    opt = torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"]
    )
    section = ds.get("scheduler")
    sched = getattr(lr_schedules, section["type"])(opt, **section["params"]) if section else None
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        if sched is not None:
            sched.step()
    return rates


def test_every_steps_rate_is_deepspeeds_scheduler_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it
    hf = f"model.init_from={_fine_tune_dir(tmp_path)}"
    with one_rank_world(str(tmp_path)):
        for name, (ds, sets, meant) in CASES.items():
            sets = tuple(hf if s == "model.init_from" else s for s in sets)
            res = _resolved(tmp_path, ds, f"train.steps={STEPS}", *sets)
            rates, _ = _engine_rates(res, STEPS)
            assert rates == _deepspeeds_rates(res.ds, STEPS), name
            assert rates == pytest.approx(meant, rel=1e-9, abs=1e-15), name
            # resumed after 5 steps: the same rates on, bit for bit
            _, state = _engine_rates(res, 5)
            assert _engine_rates(res, STEPS - 5, (state, 5))[0] == rates[5:], name
        # a schedule changed on resume: this run's, at the checkpoint's position
        _, state = _engine_rates(_resolved(tmp_path, None, "train.lr=1e-3"), 7)
        res = _resolved(tmp_path, None, "train.lr=2e-3")
        assert _engine_rates(res, 1, (state, 7))[0] == [2e-3]


def test_ds_config_says_what_rate_runs(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ADAMW_1E5))
    assert cli.main(["ds-config", "explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "  scheduler: none in the JSON -> the optimizer's lr 1e-05, constant, as DeepSpeed runs it"
    ) in out
    assert "); no scheduler: lr 1e-05, constant, as DeepSpeed runs it\n" in out
