"""dsnd/checkpoint/layout.py and commit.py on real files: commit, keep-N, leftovers, choosing
the checkpoint to resume from (no processes, no tensors: small files stand in for them)."""

from __future__ import annotations

import os

import pytest

from dsnd.checkpoint.commit import (
    prune,
    publish,
    remove_temporaries,
    temporary_dir,
    write_atomic,
    write_manifest,
)
from dsnd.checkpoint.layout import (
    FORMAT,
    CheckpointError,
    committed,
    latest,
    newest_intact,
    resolve_step_dir,
    step_dir_name,
    verify,
)
from dsnd.checkpoint.resume import checkpoint_root, choose_resume
from dsnd.config.schema import RunConfig


def save(root: str, step: int, payload: bytes = b"weights") -> str:
    """What a save does, minus the tensors: files in a temporary dir, manifest, publish."""
    name = step_dir_name(step)
    tmp = temporary_dir(root, name)
    write_atomic(os.path.join(tmp, "layer_000-model.safetensors"), payload + bytes([step]))
    write_atomic(os.path.join(tmp, "rng/rank_00000.json"), b"{}")
    write_manifest(tmp, {"format": FORMAT, "step": step},
                   ["layer_000-model.safetensors", "rng/rank_00000.json"])  # fmt: skip
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
    flip(os.path.join(newest, "layer_000-model.safetensors"))
    warnings: list[str] = []
    assert newest_intact(root, warnings.append) == os.path.join(root, "step_00000002")
    assert warnings == [f"skipping checkpoint {newest}: layer_000-model.safetensors: SHA-256 "
                        "does not match the manifest (corrupt)"]  # fmt: skip
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
