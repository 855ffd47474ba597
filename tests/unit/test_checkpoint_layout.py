"""dsnd/checkpoint/files.py and commit.py on real files: commit, keep-N, leftovers, choosing
the checkpoint to resume from, the root checked before a run (no processes; a one-tensor model
stands in for a real one)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

from dsnd.checkpoint.commit import (
    prune,
    publish,
    remove_temporaries,
    temporary_dir,
    write_atomic,
    write_manifest,
)
from dsnd.checkpoint.files import (
    FORMAT,
    CheckpointError,
    check_root,
    committed,
    latest,
    model_file,
    resolve_step_dir,
    step_dir_name,
)
from dsnd.checkpoint.resume import checkpoint_root, choose_resume
from dsnd.checkpoint.verify import newest_intact, verify
from dsnd.config.schema import RunConfig
from tests.models import spec_of

MODEL_0 = model_file(0)


def manifest_of(step: int) -> dict:
    """Every key a load reads, for a one-tensor model (as written before "dtype" existed)."""
    return {
        "format": FORMAT,
        "step": step,
        "consumed_samples": 4 * step,
        "topology": {"pp": 1, "tp": 1, "dp": 1, "world_size": 1},
        "zero_stage": 0,
        "parts": [0, 1],
        "model": spec_of("llama-tiny").manifest(),
        "versions": {"dsnd": "0.0-test"},
        "config": {},
        "corpus": {"name": "t", "tokens": 1, "sha256": ""},
        "trainer": {"optimizer_step": step, "lr": 1e-3, "lr_scheduler": None, "betas": None},
        "params": {"layers.0.w": {"file": MODEL_0, "shape": [2]}},
        "optim_keys": [],
    }


def save(root: str, step: int, value: float | None = None) -> str:
    """What a save does: files in a temporary dir, manifest, publish (`value`: the tensor's)."""
    name = step_dir_name(step)
    tmp = temporary_dir(root, name)
    tensor = torch.full((2,), float(step) if value is None else value)
    write_atomic(os.path.join(tmp, MODEL_0), safetensors_bytes({"layers.0.w": tensor}))
    write_atomic(os.path.join(tmp, "rng/rank_00000.json"), b"{}")
    write_manifest(tmp, manifest_of(step), [MODEL_0, "rng/rank_00000.json"])
    return publish(root, tmp, name)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0x20]))


def test_publish_commits_and_moves_latest(tmp_path):
    root = str(tmp_path)
    for step in (2, 4):
        final = save(root, step)
        assert latest(root) == final == os.path.join(root, step_dir_name(step))
        assert verify(final) == []
    assert committed(root) == [os.path.join(root, step_dir_name(s)) for s in (4, 2)]
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004"]
    assert not any(n.endswith(".partial") for _, _, fs in os.walk(root) for n in fs)


def test_keep_prunes_oldest_and_temporaries_are_removed(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        save(root, step)
    assert prune(root, keep=0) == []
    removed = prune(root, keep=2)
    assert sorted(os.path.basename(r) for r in removed) == ["step_00000001", "step_00000002"]
    assert [os.path.basename(d) for d in committed(root)] == ["step_00000004", "step_00000003"]
    # a save that crashed half-way: never committed, never loaded, cleaned at the next start
    crashed = temporary_dir(root, step_dir_name(5))
    write_atomic(os.path.join(crashed, "layer_000-model.safetensors"), b"half")
    assert [os.path.basename(d) for d in committed(root)][0] == "step_00000004"
    assert newest_intact(root, pytest.fail) == os.path.join(root, "step_00000004")
    assert remove_temporaries(root) == [".tmp-step_00000005"]
    assert not os.path.exists(crashed)


def test_newest_intact_skips_a_corrupt_checkpoint_with_a_warning(tmp_path):
    root = str(tmp_path)
    save(root, 2)
    newest = save(root, 4)
    flip(os.path.join(newest, MODEL_0))
    warnings: list[str] = []
    assert newest_intact(root, warnings.append) == os.path.join(root, "step_00000002")
    assert warnings == [
        f"skipping checkpoint {newest}: layer_000-model.safetensors: SHA-256 "
        "does not match the manifest (corrupt)"
    ]
    flip(os.path.join(root, "step_00000002", "manifest.json"))
    assert newest_intact(root, warnings.append) is None
    assert len(warnings) == 3


def test_resolve_step_dir(tmp_path):
    root = str(tmp_path)
    step2 = save(root, 2)
    assert resolve_step_dir(root) == step2
    assert resolve_step_dir(step2) == step2
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve_step_dir(os.path.join(root, "step_00000009"))
    with pytest.raises(CheckpointError, match="neither a step directory nor a root"):
        resolve_step_dir(str(tmp_path / "step_00000002" / "rng"))
    (tmp_path / "latest").write_text("step_00000007\n")
    with pytest.raises(CheckpointError, match="latest names step_00000007, which is missing"):
        resolve_step_dir(root)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="does not name a step directory"):
        resolve_step_dir(root)


def test_choose_resume_modes(tmp_path):
    run = RunConfig()
    run.log.dir = str(tmp_path / "log")
    assert checkpoint_root(run) == str(tmp_path / "log" / "checkpoints")
    assert choose_resume(run) is None  # auto, nothing saved yet: start fresh
    step3 = save(checkpoint_root(run), 3)
    assert choose_resume(run) == step3
    run.checkpoint.resume = "never"
    assert choose_resume(run) is None
    run.checkpoint.resume = checkpoint_root(run)
    assert choose_resume(run) == step3
    flip(os.path.join(step3, "rng", "rank_00000.json"))
    with pytest.raises(CheckpointError, match=r"rank_00000\.json: SHA-256 does not match"):
        choose_resume(run)
    run.checkpoint.dir = str(tmp_path / "elsewhere")
    run.checkpoint.resume = "auto"
    assert checkpoint_root(run) == str(tmp_path / "elsewhere") and choose_resume(run) is None


def test_auto_resume_never_picks_a_checkpoint_holding_nan(tmp_path):
    run = RunConfig()
    run.log.dir = str(tmp_path / "log")
    root = checkpoint_root(run)
    step2 = save(root, 2)
    step4 = save(root, 4, value=float("nan"))  # the loss diverged before this save
    warnings: list[str] = []
    assert newest_intact(root, warnings.append) == step2
    assert warnings == [
        f"skipping checkpoint {step4}: {MODEL_0}: holds non-finite values: layers.0.w"
    ]
    assert choose_resume(run) == step2
    run.checkpoint.resume = step4
    with pytest.raises(CheckpointError) as e:
        choose_resume(run)
    assert str(e.value) == f"{step4}/{MODEL_0}: holds non-finite values: layers.0.w"


def _latest_a_directory(root: str) -> None:
    os.remove(f"{root}/latest")
    os.mkdir(f"{root}/latest")


def _latest_a_link(root: str) -> None:
    os.remove(f"{root}/latest")
    os.symlink(f"{root}/{step_dir_name(2)}", f"{root}/latest")


def _file(path: str) -> None:
    with open(path, "w") as f:
        f.write("x")


ROOT_DAMAGE = {
    "latest is a directory": (_latest_a_directory, "latest: is not a regular file"),
    "latest is a symbolic link": (_latest_a_link, "latest: is not a regular file"),
    "a step directory is a symbolic link": (
        lambda root: os.symlink(f"{root}/{step_dir_name(2)}", f"{root}/step_00000009"),
        "step_00000009: is a symbolic link; dsnd writes step directories itself",
    ),
    "a step entry is a file": (
        lambda root: _file(f"{root}/step_00000009"),
        "step_00000009: is not a directory;",
    ),
    "a temporary step entry is a file": (
        lambda root: _file(f"{root}/.tmp-step_00000009"),
        ".tmp-step_00000009: is not a directory;",
    ),
}


@pytest.mark.parametrize("case", ROOT_DAMAGE)
def test_check_root_refuses_what_a_save_would_die_on(tmp_path, case):
    root = str(tmp_path / "ckpt")
    check_root(root)  # missing: the first save makes it
    save(root, 2)
    check_root(root)
    damage, message = ROOT_DAMAGE[case]
    damage(root)
    with pytest.raises(CheckpointError) as e:
        check_root(root)
    assert str(e.value).startswith(f"{root}/{message}"), str(e.value)


def test_check_root_refuses_a_file_as_root(tmp_path):
    _file(str(tmp_path / "file"))
    with pytest.raises(CheckpointError) as e:
        check_root(str(tmp_path / "file"))
    assert str(e.value) == f"{tmp_path / 'file'}: exists and is not a directory (checkpoint.dir)"


def test_symlinked_step_directories_are_not_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")
    elsewhere = save(str(tmp_path / "other"), 7)
    step2 = save(root, 2)
    link = os.path.join(root, step_dir_name(9))
    os.symlink(elsewhere, link)
    assert committed(root) == [step2]
    assert newest_intact(root, pytest.fail) == step2
    with pytest.raises(CheckpointError) as e:
        resolve_step_dir(link)
    assert str(e.value) == (
        f"{link}: is a symbolic link; give the step directory itself (a load "
        "reads only real directories)"
    )
    (tmp_path / "ckpt" / "latest").write_text(step_dir_name(9) + "\n")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        resolve_step_dir(root)
    warnings: list[str] = []
    assert newest_intact(root, warnings.append) == step2
    assert warnings == [f"skipping checkpoint {link}: is a symbolic link"]
    os.symlink(step2, tmp_path / "best")  # a link to a step directory under another name
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        resolve_step_dir(str(tmp_path / "best"))
