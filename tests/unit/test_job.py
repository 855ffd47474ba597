"""A job's identity and its checkpoint directory, on real files and real locks (no ranks):
which checkpoint a restart resumes, what a resume must share with the checkpoint's run, one
writer per checkpoint root, and the launcher's restart policy and diagnosis."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest

from dsnd.checkpoint.commit import publish, temporary_dir, write_manifest
from dsnd.checkpoint.files import CheckpointError, step_dir_name
from dsnd.checkpoint.resume import checkpoint_root, choose_resume, compare_with_checkpoint
from dsnd.checkpoint.root import RootLock, check_writable, probe_lock, run_dirs
from dsnd.commands.launch import absolute_path_sets, with_restarts
from dsnd.config.schema import RunConfig
from dsnd.distributed.discover import job_id
from dsnd.errors import EXIT_DIVERGED, EXIT_PEER_FAILED
from dsnd.launcher.protocol import RankOutcome, diagnose, diverged
from tests.models import spec_of
from tests.unit.test_checkpoint_layout import manifest_of, save
from tests.unit.test_ckpt_cli import LEGACY_MODEL

MODEL = spec_of("llama-tiny")


def save_for_job(root: str, step: int, job: str | None, run: dict | None = None) -> str:
    """A committed one-tensor checkpoint whose manifest names `job` (and `run`'s config)."""
    plain = save(root, step)  # real files, then the same manifest with the job id added
    manifest = {**manifest_of(step), "job_id": job, "config": {"run": run or {}, "deepspeed": {}}}
    name = step_dir_name(step)
    tmp = temporary_dir(root, name)
    os.rename(plain, tmp)
    write_manifest(tmp, manifest, ["layer_000-model.safetensors", "rng/rank_00000.json"])
    return publish(root, tmp, name)


def test_job_id_from_each_launcher():
    assert job_id({}) is None
    assert job_id({"DSND_JOB_ID": "j1", "SLURM_JOB_ID": "77"}) == "j1"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}) == "77"  # torchrun's
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "abc"  # default id names no job


@pytest.mark.parametrize("mode", ["auto", "never", "path"])
def test_a_restart_resumes_its_own_job_whatever_resume_says(tmp_path, mode):
    run = RunConfig()
    run.log.dir = str(tmp_path / "log")
    root = checkpoint_root(run)
    elsewhere = save_for_job(str(tmp_path / "given"), 2, "other")
    run.checkpoint.resume = {"path": elsewhere}.get(mode, mode)
    save_for_job(root, 8, "another-job")  # newer, but not this job's
    first = {"auto": os.path.join(root, "step_00000008"), "never": None, "path": elsewhere}[mode]
    assert choose_resume(run, "job-a") == first  # this job committed nothing yet
    own = save_for_job(root, 4, "job-a")
    assert choose_resume(run, "job-a") == own  # its own, even under never / another path
    # no job id: as checkpoint.resume says (auto: `latest`, which the last save moved)
    assert choose_resume(run, None) == (own if mode == "auto" else first)


def test_compare_refuses_another_model_and_another_runs_seed_and_data(tmp_path):
    run = RunConfig()
    then = dataclasses.asdict(run)
    manifest = {
        "model": MODEL.manifest(),
        "config": {"run": then, "deepspeed": {"gradient_clipping": 1.0}},
    }
    ds = {"gradient_clipping": 1.0}
    assert compare_with_checkpoint(run, ds, MODEL, manifest, "S", explicit=False) == []
    wider = spec_of("llama-tiny", hidden_size=128)  # head_dim follows: 128 / 4 heads
    with pytest.raises(
        CheckpointError,
        match=r"^S: written for another model \(head_dim 16 -> "
        r"32, hidden_size 64 -> 128\); resume it with the "
        r"same model",
    ):
        compare_with_checkpoint(run, ds, wider, manifest, "S", explicit=True)
    # any config value that changes the math, not only the shape
    other_eps = spec_of("llama-tiny", {"rms_norm_eps": 1e-5})
    with pytest.raises(
        CheckpointError,
        match=r"^S: written for another model \(rms_norm_eps "
        r"1e-06 -> 1e-05\)",
    ):
        compare_with_checkpoint(run, ds, other_eps, manifest, "S", explicit=True)
    run.train.seed, run.data.max_bytes = 99, 1000
    with pytest.raises(
        CheckpointError,
        match=r"other settings \(train.seed 1234 -> 99, "
        r"data.max_bytes None -> 1000\)",
    ):
        compare_with_checkpoint(run, ds, MODEL, manifest, "S", explicit=False)
    # named by path: allowed, said as warnings, with the DeepSpeed changes that alter the math
    warnings = compare_with_checkpoint(
        run, {"gradient_clipping": 0.5}, MODEL, manifest, "S", explicit=True
    )
    assert warnings == [
        "train.seed 1234 -> 99",
        "data.max_bytes None -> 1000",
        "ds.gradient_clipping 1.0 -> 0.5",
    ]
    layout = copy.deepcopy(run)
    layout.parallel.pp, layout.train.steps = 4, 500  # layout and length are free to change
    assert (
        compare_with_checkpoint(
            layout, {"gradient_clipping": 0.5}, MODEL, manifest, "S", explicit=True
        )
        == warnings
    )
    layout.eval.fraction = 0.05  # another held-out share: other samples train
    assert compare_with_checkpoint(
        layout, {"gradient_clipping": 0.5}, MODEL, manifest, "S", explicit=True
    ) == [*warnings[:2], "eval.fraction 0.02 -> 0.05", warnings[2]]


def test_compare_refuses_continuing_one_optimizers_state_with_another(tmp_path):
    run = RunConfig()
    manifest = {
        "model": MODEL.manifest(),
        "optim_keys": ["momentum_buffer"],
        "config": {"run": dataclasses.asdict(run), "deepspeed": {"optimizer": {"type": "SGD"}}},
    }
    with pytest.raises(
        CheckpointError,
        match=r"^S: written with optimizer SGD \(state: "
        r"momentum_buffer\); this run's is AdamW, which "
        r"cannot continue that state",
    ):
        compare_with_checkpoint(
            run, {"optimizer": {"type": "AdamW"}}, MODEL, manifest, "S", explicit=True
        )
    assert compare_with_checkpoint(
        run, {"optimizer": {"type": "sgd"}}, MODEL, manifest, "S", explicit=True
    ) == ["ds.optimizer.type 'SGD' -> 'sgd'"]
    adam = {
        "model": MODEL.manifest(),
        "optim_keys": ["exp_avg", "exp_avg_sq"],
        "config": {"run": dataclasses.asdict(run), "deepspeed": {"optimizer": {"type": "Adam"}}},
    }
    assert compare_with_checkpoint(
        run, {"optimizer": {"type": "AdamW"}}, MODEL, adam, "S", explicit=True
    ) == ["ds.optimizer.type 'Adam' -> 'AdamW'"]
    # each changed hyper-parameter by its key (the resumed run applies them)
    adam["config"]["deepspeed"]["optimizer"]["params"] = {"lr": 0.003, "betas": [0.9, 0.95]}
    now = {
        "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.99], "eps": 1e-6}}
    }
    assert compare_with_checkpoint(run, now, MODEL, adam, "S", explicit=True) == [
        "ds.optimizer.params.betas [0.9, 0.95] -> [0.9, 0.99]",
        "ds.optimizer.params.eps None -> 1e-06",
    ]


@pytest.mark.parametrize("preset", sorted(LEGACY_MODEL))
def test_compare_accepts_the_same_model_from_a_checkpoint_before_configs(preset):
    run = RunConfig()
    manifest = {"model": LEGACY_MODEL[preset], "config": {"run": dataclasses.asdict(run)}}
    assert compare_with_checkpoint(run, {}, spec_of(preset), manifest, "S", explicit=False) == []
    with pytest.raises(
        CheckpointError,
        match=r"^S: written for another model \(vocab_size 256 "
        r"-> 512\)",
    ):
        compare_with_checkpoint(
            run, {}, spec_of(preset, vocab_size=512), manifest, "S", explicit=False
        )


_HOLD = """
import sys, time
from dsnd.checkpoint.root import RootLock
RootLock(sys.argv[1]).acquire("job-b")
print("held", flush=True)
time.sleep(60)
"""


def test_one_writer_per_root_and_a_killed_holder_frees_it(tmp_path):
    root = str(tmp_path / "ckpt")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, root], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(CheckpointError) as refused:
            RootLock(root).acquire("job-a")
        assert str(refused.value).startswith(
            f"checkpoint.dir {root} is in use by job job-b (pid {holder.pid} on host "
        )
        assert probe_lock(root) == str(refused.value)
    finally:
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait()
    assert probe_lock(root) is None
    with RootLock(root).acquire("job-a"):
        assert probe_lock(root) is not None  # held by us now
    assert probe_lock(root) is None


def test_a_run_also_owns_its_log_dir_unless_it_holds_the_checkpoints(tmp_path):
    logs, elsewhere = str(tmp_path / "run"), str(tmp_path / "ck")
    assert run_dirs(os.path.join(logs, "checkpoints"), logs) == [
        (os.path.join(logs, "checkpoints"), "checkpoint.dir")
    ]
    assert run_dirs(elsewhere, logs) == [(elsewhere, "checkpoint.dir"), (logs, "log.dir")]
    with RootLock(logs, "log.dir").acquire("job-a"):  # another run, its own checkpoint.dir
        with pytest.raises(
            CheckpointError,
            match=r"^log.dir .* is in use by job job-a .*: one "
            r"run writes to it at a time \(wait for it to "
            r"end, or set another log.dir\)$",
        ):
            RootLock(logs, "log.dir").acquire("job-b")


def test_check_writable_names_the_directory(tmp_path):
    check_writable(str(tmp_path / "new" / "dir"), "log.dir")
    assert os.listdir(tmp_path / "new" / "dir") == []  # the probe file is gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        CheckpointError,
        match=r"^log.dir .*/file/sub is not writable \(Not a "
        r"directory\); nothing was started$",
    ):
        check_writable(str(tmp_path / "file" / "sub"), "log.dir")


def test_absolute_path_sets_pin_every_relative_path_to_the_launch_directory():
    run = RunConfig()
    run.data.path, run.checkpoint.dir, run.checkpoint.resume = "d.txt", "/abs/ck", "old/step_2"
    run.deepspeed = "zero3.json"
    assert absolute_path_sets(run, ["deepspeed=zero3.json"], "/w") == [
        "data.path=/w/d.txt",
        "log.dir=/w/runs/dsnd",
        "checkpoint.resume=/w/old/step_2",
        "deepspeed=/w/zero3.json",
    ]
    assert absolute_path_sets(run, [], "/w")[-1] == "checkpoint.resume=/w/old/step_2"


def outcome(rank, code, by_agent=False, at=0.0):
    return RankOutcome(rank, "h", code, 0.0, by_agent, at)


def test_diagnose_names_the_cause_not_the_peer_that_saw_it_first():
    # rank 0 lost its connection (and exited) before rank 1, whose disk was full, had exited
    got = diagnose([outcome(0, EXIT_PEER_FAILED, at=1.0), outcome(1, 1, at=1.5)])
    assert got == "rank 1 on host h exited with code 1"
    got = diagnose([outcome(0, EXIT_PEER_FAILED, at=1.0), outcome(1, -9, by_agent=True)])
    assert got == "rank 0 on host h exited with code 4 (a peer failed first)"
    div = [outcome(0, EXIT_DIVERGED, at=1.0), outcome(1, -9, by_agent=True, at=1.1)]
    assert diagnose(div) == "rank 0 on host h exited with code 3 (training diverged)"
    assert diverged(div) and not diverged([outcome(0, 1)])


def test_with_restarts_runs_every_attempt_alike_and_never_repeats_a_final_failure(capsys):
    calls = []

    def attempt(results):
        def run(sets):
            calls.append(sets)
            return results[len(calls) - 1]

        return run

    assert with_restarts(attempt([("rank 1 ... SIGKILL", False), (None, False)]), ["a=1"], 3) == 0
    assert calls == [["a=1"], ["a=1"]]  # the same job id: the ranks pick the job's checkpoint
    assert "restarting from this job's last committed checkpoint" in capsys.readouterr().err
    calls.clear()
    assert with_restarts(attempt([("rank 0 ... (training diverged)", True)]), [], 3) == 1
    assert len(calls) == 1
    assert capsys.readouterr().err == "dsnd: job failed: rank 0 ... (training diverged)\n"
