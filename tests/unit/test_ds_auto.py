"""The DeepSpeed JSONs users already have: "auto" values, missing sections, do-nothing sections,
keys DeepSpeed ignores, and every problem reported at once."""

from __future__ import annotations

import json

import pytest

from dsnd import cli
from dsnd.config.ds_auto import HF_BUCKETS, fill_auto, packaged, remaining_autos
from dsnd.config.load import load
from dsnd.config.lr_schedule import DSND
from dsnd.config.resolve import resolve
from dsnd.errors import UserError, UserErrors

# transformers' tests/deepspeed/ds_config_zero3.json, as the Hugging Face Trainer users have it
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def write(tmp_path, ds: dict) -> str:
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "run.yaml").write_text("deepspeed: ds.json\ntrain:\n  steps: 7\n")
    return str(tmp_path / "run.yaml")


def test_hf_zero3_auto_config_resolves_as_the_trainer_would(tmp_path):
    res = resolve(load(write(tmp_path, HF_ZERO3)), 2)
    ds, defaults = res.ds, packaged()
    assert remaining_autos(ds) == []
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        defaults["train_micro_batch_size_per_gpu"],
        1,
    )
    assert ds["train_batch_size"] == 2 * ds["train_micro_batch_size_per_gpu"]  # dp = 2
    params = ds["optimizer"]["params"]
    assert [params[k] for k in ("lr", "betas", "eps", "weight_decay")] == [
        DSND.lr,
        *(DSND.optimizer[k] for k in ("betas", "eps", "weight_decay")),
    ]
    sched = ds["scheduler"]["params"]
    assert sched["total_num_steps"] == 7  # train.steps
    assert (sched["warmup_min_lr"], sched["warmup_max_lr"]) == (DSND.min_lr, DSND.lr)
    assert ds["gradient_clipping"] == 1.0
    hidden = res.model.hidden_size
    zero = ds["zero_optimization"]
    assert [zero[k] for k in HF_BUCKETS] == [
        hidden * hidden,
        int(0.9 * hidden * hidden),
        10 * hidden,
    ]
    # "auto" precision is fp32 as the HF Trainer's is without --bf16 (this CPU has bf16: it
    # is not switched on behind the user's back), and the disabled fp16 section is noted
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert (
        "bf16, fp16: 'auto' -> fp32, as the Hugging Face Trainer does without --bf16 / "
        '--fp16 ("enabled": true, or --set ds.bf16.enabled=true, asks for it)' in res.ds_notes
    )
    assert "fp16: at its do-nothing value, ignored" in res.ds_notes
    assert "scheduler.params.total_num_steps: 'auto' -> 7 (train.steps)" in res.ds_notes


def test_fill_auto_leaves_numbers_alone_and_fills_only_what_it_knows():
    ds = {
        "train_batch_size": 32,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"},
    }
    filled, notes = fill_auto(ds, hidden=64, steps=10)
    assert filled["train_batch_size"] == 32 and filled["optimizer"]["params"] == {"lr": 1e-4}
    assert filled["scheduler"]["params"]["warmup_num_steps"] == DSND.warmup_steps
    assert remaining_autos(filled) == []
    assert filled["zero_optimization"]["allgather_bucket_size"] == 500_000_000  # DeepSpeed's
    assert ds["scheduler"]["params"]["warmup_num_steps"] == "auto"  # the input is not changed
    assert notes == [
        "scheduler.params.warmup_num_steps: 'auto' -> 5 (dsnd's default)",
        "gradient_clipping: none in the JSON -> DeepSpeed's default 1 (clipping by the global "
        "norm; set 0 to turn it off)",
        "zero_optimization.allgather_bucket_size: 'auto' -> 500000000 (DeepSpeed's default, "
        "which DeepSpeed itself would use)",
    ]
    assert filled["gradient_clipping"] == 1.0  # what DeepSpeed 0.19.8 clips at unasked


def test_deepspeeds_clipping_default_is_what_its_engine_reads():
    """The note's number is DeepSpeed's: its config parse of a JSON without the key."""
    from dsnd.engine.deepspeed_api import deepspeed_config

    bare = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
    }
    filled, _ = fill_auto(bare, hidden=64, steps=1)
    assert deepspeed_config(bare).gradient_clipping == filled["gradient_clipping"] == 1.0
    kept, notes = fill_auto({**bare, "gradient_clipping": 0.0}, hidden=64, steps=1)
    assert kept["gradient_clipping"] == 0.0 and not any("clipping" in n for n in notes)


def test_bf16_auto_is_fp32_and_enabled_true_is_bf16():
    filled, notes = fill_auto({"bf16": {"enabled": "auto"}}, 64, 10)
    assert filled["bf16"] == {"enabled": False}
    assert any(n.startswith("bf16: 'auto' -> fp32, as the Hugging Face Trainer") for n in notes)
    res = resolve(load(None, ["ds.bf16.enabled=auto"]), 1)
    assert res.ds["bf16"]["enabled"] is False
    res = resolve(load(None, ["ds.bf16.enabled=true"]), 1)
    assert res.ds["bf16"]["enabled"] is True


AUTO_BATCH = {
    k: "auto"
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
}


@pytest.mark.parametrize(
    "pp, dp, micro, gas", [(1, 2, 2, 1), (2, 1, 2, 4), (2, 2, 2, 4), (4, 1, 2, 8)]
)
def test_auto_batch_gives_a_pipeline_two_micro_batches_per_stage(tmp_path, pp, dp, micro, gas):
    res = resolve(
        load(write(tmp_path, AUTO_BATCH), [f"parallel.pp={pp}", "model.num_layers=4"]), pp * dp
    )
    assert tuple(res.batch) == (micro * gas * dp, micro, gas)
    (note,) = [n for n in res.ds_notes if n.startswith("train_batch_size, ")]
    assert "train_micro_batch_size_per_gpu 2 (dsnd's packaged JSON)" in note
    assert (f"gradient_accumulation_steps {gas} (2 x parallel.pp={pp}" in note) == (pp > 1)


def test_auto_gas_with_a_train_batch_fills_2pp_where_it_divides(tmp_path):
    ds = {**AUTO_BATCH, "train_batch_size": 16}
    res = resolve(load(write(tmp_path, ds), ["parallel.pp=2"]), 4)  # dp 2: 16 = 2 x 4 x 2
    assert tuple(res.batch) == (16, 2, 4)
    ds = {**AUTO_BATCH, "train_batch_size": 6}  # 6 / (4 x dp 1): not whole
    res = resolve(load(write(tmp_path, ds), ["parallel.pp=2"]), 2)
    assert tuple(res.batch) == (6, 6, 1)
    assert any(
        "which 4 x dp=1 does not divide: fewer than 2 x parallel.pp=2 micro-batches" in n
        for n in res.ds_notes
    )
    ds = {**AUTO_BATCH, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}
    res = resolve(load(write(tmp_path, ds), ["parallel.pp=2"]), 2)  # both set: gas is 2
    assert tuple(res.batch) == (16, 8, 2)


def test_an_auto_dsnd_cannot_fill_is_refused_by_name():
    with pytest.raises(
        UserError,
        match=r"optimizer.params.amsgrad: 'auto' is not a value dsnd "
        "can fill here; set a value",
    ):
        resolve(load(None, ["ds.optimizer.params.amsgrad=auto"]), 1)


def test_keys_deepspeed_ignores_are_noted_and_near_misses_refused():
    res = resolve(
        load(
            None,
            [
                "ds.cuda_visible_devices=0",
                "ds.hybrid_engine.enabled=false",
                "ds.activation_checkpointing.partition_activations=true",
            ],
        ),
        1,
    )
    assert "cuda_visible_devices: not a key DeepSpeed reads; ignored, as DeepSpeed does" in (
        res.ds_notes
    )
    assert "hybrid_engine: at its do-nothing value, ignored" in res.ds_notes
    assert any(n.startswith("activation_checkpointing: ignored: ") for n in res.ds_notes)
    with pytest.raises(
        UserError,
        match=r"unknown key 'gradient_clippin' \(did you mean "
        r"'gradient_clipping'\?\)",
    ):
        resolve(load(None, ["ds.gradient_clippin=1.0"]), 1)


def test_every_problem_is_reported_at_once_each_blamed_on_its_cause(capsys):
    sets = [
        "ds.train_batch_szie=16",
        "ds.amp.enabled=true",
        "ds.gradient_clipping=-1",
        "ds.optimizer.params.betas=[2, 0.9]",
    ]
    with pytest.raises(UserErrors) as e:
        resolve(load(None, sets), 1)
    assert e.value.problems == [
        "--set ds.train_batch_szie=16: unknown key 'train_batch_szie' (did you mean "
        "'train_batch_size'?)",
        "--set ds.amp.enabled=true: 'amp' is refused: apex AMP is not supported by dsnd; use bf16",
        "--set ds.gradient_clipping=-1: gradient_clipping must be >= 0 (0 = off), got -1",
        "--set ds.optimizer.params.betas=[2, 0.9]: optimizer.params.betas must each be in "
        "[0, 1), got [2, 0.9]",
    ]
    argv = ["launch", "--nprocs", "1", "--dry-run", *[a for s in sets for a in ("--set", s)]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("dsnd: error: --set ds.") for line in err)


def test_warmup_decay_with_a_string_total_is_refused_before_start():
    item = 'ds.scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "x"}}'
    with pytest.raises(UserError, match="scheduler.params.total_num_steps must be a number"):
        resolve(load(None, [item]), 1)


def test_model_state_formula_matches_what_deepspeed_was_measured_to_keep():
    from dsnd.plan.memory import model_state_bytes

    psi = 217664  # dsnd bench zero-memory measured these bytes at dp=2
    assert model_state_bytes(1, psi, 2, bf16=False)["device"] == {
        "params": 870656,
        "grads": 870656,
        "master": 435328,
        "optimizer": 870656,
    }
    assert model_state_bytes(3, psi, 2, bf16=False)["device"] == {
        "params": 435328,
        "grads": 435328,
        "master": 435328,
        "optimizer": 870656,
    }
    assert model_state_bytes(0, 10, 4, bf16=False)["device"]["master"] == 0
    off = model_state_bytes(3, 100, 2, bf16=True, offload_optimizer=True, offload_param=True)
    assert off == {
        "device": {"grads": 100.0},
        "cpu": {"params": 100.0, "master": 200.0, "optimizer": 400.0},
    }
    # parameter offload needs ZeRO-3, optimizer offload ZeRO 1-3: elsewhere nothing moves
    assert model_state_bytes(0, 100, 2, False, True, True)["cpu"] == {}


def test_ds_config_check_and_explain(tmp_path, capsys):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(HF_ZERO3))
    assert cli.main(["ds-config", "check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: dsnd will run it (1 rank)"
    assert "  wall_clock_breakdown: used as written" in out
    assert "  gradient_clipping: 'auto' -> 1.0" in out
    assert any(line.startswith("  steps_per_print: DeepSpeed's own progress") for line in out)
    assert len(out) == len(set(out))  # a note naming several keys is shown once
    # every nested key has its line: used, filled in, or of no effect and why
    for key in (
        "overlap_comm",
        "contiguous_gradients",
        "sub_group_size",
        "stage3_max_live_parameters",
    ):
        assert f"  zero_optimization.{key}: used as written" in out
    assert (
        "  zero_optimization.stage3_gather_16bit_weights_on_model_save: has no effect here: "
        "DeepSpeed reads it in save_16bit_model, which dsnd does not call"
    ) in "\n".join(out)
    assert "  optimizer.params.lr: 'auto' -> 0.003 (dsnd's default)" in out
    shown = {k for line in out[1:] for k in line.split(":")[0].strip().split(", ")}

    def has_lines(path: str, value) -> bool:  # its own line (about all of it), or its keys'
        return (
            path in shown
            or isinstance(value, dict)
            and all(has_lines(f"{path}.{k}", v) for k, v in value.items())
        )

    assert all(has_lines(key, value) for key, value in HF_ZERO3.items())
    argv = ["ds-config", "explain", str(path), "--nprocs", "4", "--set", "parallel.pp=2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # "auto" batch keys at pp=2: 2 x pp micro-batches per step, not a step of mostly bubble
    assert "batch: train_batch_size 16 = micro 2 x gradient_accumulation_steps 4 x dp 2" in out
    assert "\nprecision: fp32\n" in out
    assert "ZeRO-3 over each stage's 2 data-parallel ranks; offload: optimizer none" in out
    assert out.count(" MiB on the device, 0.0 MiB in CPU memory") == 2  # two stages, no offload


def test_ds_config_check_reports_every_problem_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_szie": 8, "zero_optimization": {"stage": 5}}))
    assert cli.main(["ds-config", "check", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dsnd: error: {path}: unknown key 'train_batch_szie' (did you mean 'train_batch_size'?)",
        f"dsnd: error: {path}: zero_optimization.stage must be 0, 1, 2 or 3, got 5",
    ]


def test_deepspeed_monitors_are_written_by_dsnd_where_deepspeed_would(tmp_path):
    from dsnd.report.reporter import Reporter

    tb, csv = tmp_path / "tb", tmp_path / "csv"
    sets = [
        f"log.dir={tmp_path / 'run'}",
        "log.tensorboard=false",
        f'ds.tensorboard={{"enabled": true, "output_path": "{tb}", "job_name": "job"}}',
        f'ds.csv_monitor={{"enabled": true, "output_path": "{csv}"}}',
    ]
    res = resolve(load(None, sets), 1)
    assert res.monitors == {
        "tensorboard": {"enabled": True, "output_path": str(tb), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": str(csv)},
    }
    assert "tensorboard" not in res.ds and "csv_monitor" not in res.ds  # not DeepSpeed's to write
    assert f"tensorboard: written by dsnd into {tb / 'job'}" in res.ds_notes
    reporter = Reporter(res)
    for step in (1, 2):
        row = {
            "step": step,
            "loss": 3.0 / step,
            "lr": 0.1,
            "grad_norm": 1.0,
            "step_time_s": 1.0,
            "tokens_per_s": 100.0,
        }
        reporter.write(row, {})
    reporter.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tb / "job").iterdir())
    lines = (csv / "DeepSpeedJobName" / "train_loss.csv").read_text().splitlines()
    assert lines == ["step,train/loss", "1,3.0", "2,1.5"]
    with pytest.raises(
        UserError,
        match=r"tensorboard: unknown key 'outpt_path' \(did you mean "
        r"'output_path'\?\)",
    ):
        resolve(load(None, ['ds.tensorboard={"enabled": true, "outpt_path": "x"}']), 1)


def test_the_wandb_monitor_is_written_by_dsnd_offline(tmp_path, monkeypatch):
    """DeepSpeed's wandb section: dsnd's steps and scalars, in the project the section names,
    run files under log.dir. wandb 0.31 has no Python reader of its run file (its core is a Go
    service), so the test looks for the scalar, the project and the values in its bytes."""
    from dsnd.report.reporter import Reporter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sets = [
        f"log.dir={tmp_path / 'run'}",
        "log.tensorboard=false",
        'ds.wandb={"enabled": true, "project": "dsnd-proj", "group": "g1"}',
    ]
    res = resolve(load(None, sets), 1)
    assert "wandb" not in res.ds  # not DeepSpeed's to write
    assert any(n.startswith("wandb: written by dsnd to project 'dsnd-proj'") for n in res.ds_notes)
    reporter = Reporter(res)
    for step in (1, 2):
        reporter.write(
            {
                "step": step,
                "loss": 3.0 / step,
                "lr": 0.1,
                "grad_norm": 1.25,
                "step_time_s": 1.0,
                "tokens_per_s": 100.0,
            },
            {},
        )
    reporter.close()
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    for expected in (b"dsnd-proj", b"g1", b"train/loss", b"train/grad_norm", b"1.25", b"1.5"):
        assert expected in data, expected
    with pytest.raises(UserError, match=r"wandb: unknown key 'projct' \(did you mean 'project'"):
        resolve(load(None, ['ds.wandb={"enabled": true, "projct": "x"}']), 1)


@pytest.mark.parametrize(
    "stage, key, why",
    [
        (3, "stage3_gather_16bit_weights_on_model_save", "which dsnd does not call"),
        (2, "stage3_max_live_parameters", "only ZeRO-3 reads it, and zero_optimization.stage is 2"),
        (1, "sub_group_size", "only ZeRO-3 reads it, and zero_optimization.stage is 1"),
        (3, "allgather_bucket_size", "only ZeRO-1/2 read it, and zero_optimization.stage is 3"),
        (0, "overlap_comm", "zero_optimization.stage 0 builds no ZeRO optimizer"),
        (2, "load_from_fp32_weights", "when it loads its own checkpoints"),
    ],
)
def test_zero_keys_without_effect_are_said_at_start(stage, key, why):
    res = resolve(
        load(None, [f"deepspeed=ds_configs/zero{stage}.json", f"ds.zero_optimization.{key}=true"]),
        1,
    )
    (note,) = [n for n in res.ds_notes if n.startswith(f"zero_optimization.{key}: ")]
    assert "has no effect here" in note and why in note
    # and the keys the stage reads have no such note
    res = resolve(
        load(None, ["deepspeed=ds_configs/zero2.json", "ds.zero_optimization.overlap_comm=true"]), 1
    )
    assert not [n for n in res.ds_notes if "has no effect" in n]
