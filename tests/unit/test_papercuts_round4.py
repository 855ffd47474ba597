"""Small things a user ran into (issue 37, item 3), each on real files and the real CLI entry
(in-process, no ranks): what an import, a lock, a stopped export, a resume, a config without
`deepspeed:`, a huge `--set`, a rope override, `dsnd plan`'s numbers, an MoE model's expert
counts, `ckpt verify` during rotation and a stale op-build lock say."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from dsnd import cli
from dsnd.checkpoint.files import CheckpointError, step_dir_name
from dsnd.checkpoint.root import RootLock
from dsnd.errors import UserError
from tests.models import spec_of
from tests.unit.test_checkpoint_layout import save


def _said(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(capsys, *argv: str) -> str:
    rc, _, err = _said(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("dsnd: error: "), err[:2000]
    return err.removeprefix("dsnd: error: ").removesuffix("\n")


# --- 1, 2: `dsnd ckpt import` blames the DeepSpeed file and key, and reads no string step ---


def _ds_optim_file(tag, name: str, state: dict) -> str:
    """An optimizer file as DeepSpeed's ZeRO-1/2 writes it (the keys a conversion reads)."""
    path = os.path.join(tag, name)
    torch.save(
        {
            "optimizer_state_dict": {
                "base_optimizer_state": {
                    "state": {0: state},
                    "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}],
                },
                "single_partition_of_fp32_groups": [torch.zeros(8)],
            }
        },
        path,
    )
    return path


def _universal(tmp_path, name: str, **files) -> str:
    """A converter's output for parameter `name`: zero/<name>/<key>.pt."""
    universal = tmp_path / "universal"
    (universal / "zero" / name).mkdir(parents=True)
    for key, value in files.items():
        torch.save(value, universal / "zero" / name / f"{key}.pt")
    return str(universal)


def test_import_blames_non_finite_optimizer_state_on_the_deepspeed_file_and_key(tmp_path):
    from dsnd.checkpoint import import_ds

    tag = tmp_path / "global_step3"
    tag.mkdir()
    _ds_optim_file(
        tag,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        {"step": torch.tensor(3.0), "exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)},
    )
    bad = _ds_optim_file(
        tag,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        {
            "step": torch.tensor(3.0),
            "exp_avg": torch.tensor([0.0, float("nan")]),
            "exp_avg_sq": torch.zeros(8),
        },
    )
    universal = _universal(tmp_path, "w", exp_avg=torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(UserError) as refused:
        import_ds._tensor(universal, "w", "exp_avg", (1, 2), str(tag))
    assert str(refused.value) == (
        f"{bad}: 'optimizer_state_dict.base_optimizer_state.state[0].exp_avg' holds NaN or "
        "infinite values (DeepSpeed's conversion carried them into parameter w's exp_avg); "
        "dsnd continues only a finite state"
    )
    assert ".tmp-step" not in str(refused.value)


@pytest.mark.parametrize("step", ["3", 3.5, True, torch.tensor([3, 3])])
def test_import_refuses_an_optimizer_step_that_is_not_an_integer(tmp_path, step):
    from dsnd.checkpoint import import_ds

    tag = tmp_path / "global_step3"
    tag.mkdir()
    path = _ds_optim_file(
        tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt", {"step": step, "exp_avg": torch.zeros(8)}
    )
    universal = _universal(tmp_path, "w", step=step)
    with pytest.raises(UserError) as refused:
        import_ds._adam_step(universal, ["w"], {}, str(tag))
    assert str(refused.value).startswith(
        f"{path}: 'optimizer_state_dict.base_optimizer_state.state[0].step' is "
    ), refused.value
    assert str(refused.value).endswith(
        "expected a non-negative integer (an int, or a one-element tensor holding one)"
    )


def test_import_reads_integer_steps_as_deepspeed_writes_them(tmp_path):
    from dsnd.checkpoint import import_ds

    for i, step in enumerate([3, torch.tensor(3.0), torch.tensor(3)]):
        universal = _universal(tmp_path / str(i), "w", step=step)
        assert import_ds._adam_step(universal, ["w"], {}, str(tmp_path)) == 3


# --- 3: the lock names its holder truly ---


def test_a_lock_held_without_a_job_id_does_not_say_job_none(tmp_path):
    root = str(tmp_path / "ck")
    with RootLock(root).acquire(None):  # another descriptor of this process conflicts (flock)
        with pytest.raises(CheckpointError) as refused:
            RootLock(root).acquire("job-b")
    said = str(refused.value)
    assert "None" not in said, said
    assert said.startswith(
        f"checkpoint.dir {root} is in use by a dsnd process without a job id "
        f"(pid {os.getpid()} on host "
    ), said


# --- 4: a stopped run's export ---


def test_a_stopped_run_says_it_did_not_export():
    from dsnd.trainer import export_skipped

    assert export_skipped("hf") == (
        "checkpoint.export_hf: not exported to hf (stopped before train.steps; the export is "
        "written when a run completes): resume to finish the run, or export the saved "
        "checkpoint with dsnd ckpt export"
    )


def test_a_refused_start_leaves_no_export_directory_it_made(capsys, tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSND_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "exports" / "hf"
    said = _one_error_line(
        capsys,
        "train",
        "--set",
        "log.tensorboard=false",
        "--set",
        f"checkpoint.export_hf={target}",
        "--set",
        f"checkpoint.resume={tmp_path / 'missing'}",
    )
    assert "missing" in said
    assert not (tmp_path / "exports").exists()


# --- 5: a capacity factor changed on resume ---


@pytest.mark.parametrize(("then", "now"), [(None, 1.25), (1.25, None), (1.0, 2.0)])
def test_resume_warns_when_the_capacity_factor_changes(then, now):
    from dsnd.checkpoint.resume import compare_with_checkpoint
    from dsnd.config.schema import RunConfig

    spec = spec_of("mixtral-tiny")
    before, after = RunConfig(), RunConfig()
    before.model.moe_capacity_factor, after.model.moe_capacity_factor = then, now
    manifest = {"model": spec.manifest(), "config": {"run": dataclasses.asdict(before)}}
    said = compare_with_checkpoint(after, {}, spec, manifest, "S", explicit=False)
    assert said == [f"model.moe_capacity_factor {then!r} -> {now!r}"]
    assert compare_with_checkpoint(before, {}, spec, manifest, "S", explicit=False) == []


# --- 6: a run YAML without `deepspeed:` ---


def test_a_yaml_without_deepspeed_takes_the_packaged_default(tmp_path):
    from dsnd.config.load import load
    from dsnd.config.packaged import packaged_json

    run = tmp_path / "run.yaml"
    run.write_text("train:\n  steps: 3\n")
    loaded = load(str(run))
    assert loaded.ds_path == packaged_json(0)
    assert loaded.ds["zero_optimization"]["stage"] == 0
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    run.write_text("deepspeed: ds.json\n")  # written: relative to the YAML, as before
    assert load(str(run)).ds_path == str(tmp_path / "ds.json")


# --- 7: a huge --set value is not echoed whole ---

HUGE = "x" * 100_000


@pytest.mark.parametrize(
    "item",
    [
        f"model.seq_len={HUGE}",
        f'log.dir=["{HUGE}"]',
        f"data.format={HUGE}",
        f"model.preset={HUGE}",
        f"parallel.partition={HUGE}",
        f"ds.train_batch_size={HUGE}",
        f"model.overrides.rope_theta={HUGE}",
        f"{HUGE}=1",
    ],
)
def test_set_errors_shorten_the_values_they_echo(capsys, item):
    said = _one_error_line(capsys, "launch", "--nprocs", "1", "--dry-run", "--set", item)
    assert len(said) < 600 and "… (100" in said, said[:600]


def test_shown_keeps_short_values_and_cuts_long_ones():
    from dsnd.errors import shown

    assert shown("abc") == "'abc'" and shown([1, 2]) == "[1, 2]"
    cut = shown("y" * 1000)
    assert cut == "'" + "y" * 79 + "… (1002 chars)"


# --- 8: the documented rope override ---


@pytest.mark.parametrize("preset", ["llama-tiny", "mixtral-tiny", "llama-3.2-1b"])
def test_rope_theta_override_works_on_either_config_form(preset):
    from dsnd.model.source import load_model

    spec = load_model(preset, "model.preset", overrides={"rope_theta": 500000.0})
    assert spec.config.rope_parameters["rope_theta"] == 500000.0
    with pytest.raises(UserError, match="rope_theta=1.0 disagrees with rope_parameters"):
        load_model(
            preset,
            "model.preset",
            overrides={
                "rope_theta": 1.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 2.0},
            },
        )


# --- 9: dsnd plan's numbers ---


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "1000000000"], "--world 1000000000 is above 1048576 devices"),
        (["--world", "8", "--gpu-mem", "nan"], "--gpu-mem must be a finite number > 0, got nan"),
        (["--world", "8", "--gpu-mem", "inf"], "--gpu-mem must be a finite number > 0, got inf"),
        (["--world", "8", "--gpu-mem", "-1"], "--gpu-mem must be a finite number > 0, got -1.0"),
        (["--world", "8", "--intra-bw", "nan"], "--intra-bw must be a finite number > 0, got nan"),
        (["--world", "8", "--top", "0"], "--top must be >= 1, got 0"),
    ],
)
def test_plan_refuses_numbers_it_cannot_plan_with(capsys, argv, message):
    start = time.monotonic()
    said = _one_error_line(capsys, "plan", "--gpu", "h100", *argv)
    assert said.startswith(message), said
    assert time.monotonic() - start < 30


# --- 10: an MoE model's expert counts ---


def _dry_run(capsys, *sets: str) -> str:
    argv = ["launch", "--nprocs", "2", "--dry-run"]
    for item in sets:
        argv += ["--set", item]
    return _one_error_line(capsys, *argv)


def test_no_experts_is_named_as_such(capsys):
    said = _dry_run(capsys, "model.preset=mixtral-tiny", "model.overrides.num_local_experts=0")
    assert said.endswith("num_local_experts=0: must be >= 1 (routed experts per layer)"), said
    said = _dry_run(capsys, "model.preset=qwen3-moe-tiny", "model.overrides.num_experts=1")
    assert said.endswith(
        "num_experts_per_tok=2: must be in 1..1, the number of experts per layer"
    ), said


@pytest.mark.parametrize(
    "dense",
    ["model.overrides.decoder_sparse_step=100", "model.overrides.mlp_only_layers=[0, 1, 2, 3]"],
)
def test_expert_parallelism_needs_a_layer_with_experts(capsys, dense):
    said = _dry_run(capsys, "model.preset=qwen3-moe-tiny", dense, "parallel.ep=2")
    assert said.startswith("parallel.ep=2: preset qwen3-moe-tiny has no layer with experts"), said


# --- 12: ckpt verify during rotation, and a manifest whose step is not its directory's ---


def test_verify_of_a_root_follows_latest_when_keep_rotates_mid_read(capsys, tmp_path, monkeypatch):
    """A run saves step 4 and `checkpoint.keep: 1` removes step 2 while verify reads it."""
    from dsnd.checkpoint import verify as verify_mod
    from dsnd.checkpoint.commit import prune

    root = str(tmp_path / "ck")
    save(root, 2)
    real, pending = verify_mod._file_problem, [4]

    def a_save_meanwhile(step_dir, files, rel):
        if pending:  # the first file read: the run commits its next step and rotates
            save(root, pending.pop())
            prune(root, 1)
        return real(step_dir, files, rel)

    monkeypatch.setattr(verify_mod, "_file_problem", a_save_meanwhile)
    rc, out, err = _said(capsys, "ckpt", "verify", root)
    assert (rc, out) == (0, f"ok: {root}/step_00000004 (4 files)\n"), err
    assert err == (
        f"dsnd: {root}/step_00000002 was removed while it was verified (rotated "
        "away by checkpoint.keep); verifying what latest names now\n"
    )
    pending.append(6)
    rc, out, err = _said(capsys, "ckpt", "verify", f"{root}/step_00000004")
    assert (rc, out) == (2, ""), err
    assert err == (
        f"dsnd: error: {root}/step_00000004: removed while it was verified (rotated "
        "away by checkpoint.keep?); nothing left to verify\n"
    )


def test_a_manifest_step_other_than_its_directory_is_refused(capsys, tmp_path):
    from dsnd.checkpoint.resume import choose_resume
    from dsnd.config.schema import RunConfig

    root = tmp_path / "ck"
    os.rename(save(str(root), 2), root / step_dir_name(3))
    moved = str(root / step_dir_name(3))
    rc, _, err = _said(capsys, "ckpt", "verify", moved)
    assert rc == 1
    assert err == (
        f"{moved}/manifest.json: 'step' is 2, but the directory is named "
        "step_00000003 (a resume would continue one step off)\n"
    )
    run = RunConfig()
    run.checkpoint.resume = moved
    with pytest.raises(CheckpointError, match="'step' is 2, but the directory is named"):
        choose_resume(run)


# --- 13: a stale op-build lock ---


def test_a_build_lock_no_process_holds_is_removed(tmp_path):
    from dsnd.extensions import remove_stale_lock

    build = tmp_path / "cpu_adam"
    build.mkdir()
    assert remove_stale_lock(str(build)) is None  # no lock
    lock = build / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while building
    try:
        assert remove_stale_lock(str(build), settle_s=0.0) is None and lock.exists()
    finally:
        os.close(fd)  # a build killed midway: the descriptor is gone, the file stays
    said = remove_stale_lock(str(build), settle_s=0.0)
    assert said == (
        f"removed the stale build lock {lock} (no process holds it: a build was killed midway)"
    )
    assert not lock.exists()
