"""Checkpoints a load or verify must refuse, on real files through the real CLI.

Each case edits a copy of a committed checkpoint (tests/unit/test_ckpt_cli.py's fixture) the
way a person, a foreign tool or an attacker would: paths that leave the step directory,
symbolic links, files no checksum covers, malformed manifest entries, safetensors headers
edited with the checksums recomputed, NaN weights, a root a save would die on. Every one must
end as one line naming the file (no traceback): `dsnd ckpt verify` exits 1 (2 when DIR is not a
checkpoint at all), and the load side (`read_full_model`, the `member` and `tensor_file` gates
`load_checkpoint` opens files through) raises CheckpointError.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsnd import cli
from dsnd.checkpoint.commit import write_manifest
from dsnd.checkpoint.contents import expected_tensors, tensor_file
from dsnd.checkpoint.files import (
    MANIFEST,
    MANIFEST_SUM,
    MAX_STEP,
    CheckpointError,
    check_root,
    model_file,
    optim_file,
    rng_file,
    step_dir_name,
)
from dsnd.checkpoint.load import _restore_rng, read_full_model
from dsnd.checkpoint.members import member
from dsnd.checkpoint.verify import check_intact, read_manifest
from dsnd.model.families import FAMILIES
from tests.procs import run_cli
from tests.unit.test_ckpt_cli import LEGACY_MODEL, STEP, write_checkpoint

STEP_RANGE = f"an integer in [0, {MAX_STEP}] (a step directory's name holds 8 digits)"

MODEL_1, OPTIM_1 = model_file(1), optim_file(1)
NORM = "layers.1.input_layernorm.weight"  # shape [64]
GATE = "layers.1.mlp.gate_proj.weight"  # shape [176, 64]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("hostile") / "ckpt")
    write_checkpoint(root, "llama-tiny")
    return root


@pytest.fixture
def ckpt(pristine, tmp_path) -> tuple[str, str]:
    """(root, step dir): a private copy to damage."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root, symlinks=True)
    return root, os.path.join(root, step_dir_name(STEP))


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def manifest_of(step_dir: str) -> dict:
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def recommit(step_dir: str, manifest: dict) -> None:
    """Write `manifest` as the step's manifest, every checksum recomputed from the files it
    lists (what someone covering an edit would do)."""
    write_manifest(
        step_dir, {k: v for k, v in manifest.items() if k != "files"}, sorted(manifest["files"])
    )


def reseal(step_dir: str, manifest: dict) -> None:
    """Write `manifest` exactly as given (its files table too) and its own checksum."""
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    with open(os.path.join(step_dir, MANIFEST), "wb") as f:
        f.write(text)
    with open(os.path.join(step_dir, MANIFEST_SUM), "w") as f:
        f.write(hashlib.sha256(text).hexdigest() + "\n")


def edit_header(path: str, edit) -> None:
    """Rewrite the safetensors header of `path` through `edit(header dict)`, data untouched."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def verify_lines(capsys, where: str, rc: int = 1) -> list[str]:
    """`dsnd ckpt verify where`'s stderr lines, after checking its exit code and that nothing
    else was printed."""
    got = cli.main(["ckpt", "verify", where])
    out, err = capsys.readouterr()
    assert (got, out) == (rc, ""), err
    assert "Traceback" not in err and err.endswith("\n")
    return err.splitlines()


def refused(load, *args) -> str:
    """The one-line CheckpointError `load(*args)` raises."""
    with pytest.raises(CheckpointError) as e:
        load(*args)
    message = str(e.value)
    assert "\n" not in message
    return message


def _point_param_at(step_dir: str, rel: str) -> None:
    manifest = manifest_of(step_dir)
    manifest["params"][NORM]["file"] = rel
    recommit(step_dir, manifest)


@pytest.mark.parametrize("where", ["../x.safetensors", "/abs"])
def test_a_param_file_outside_the_step_dir(capsys, ckpt, tmp_path, where):
    _, step_dir = ckpt
    rel = where if where.startswith("..") else str(tmp_path / "abs.safetensors")
    shutil.copy(os.path.join(step_dir, MODEL_1), os.path.join(step_dir, rel))  # a real file
    _point_param_at(step_dir, rel)
    outside = f"{os.path.join(step_dir, rel)}: lies outside the step directory"
    assert verify_lines(capsys, step_dir)[0] == f"{outside}; params['{NORM}'] names it"
    manifest = read_manifest(step_dir)
    assert refused(read_full_model, step_dir, manifest) == outside
    assert refused(member, step_dir, manifest, rel) == outside


def test_a_symlinked_file(capsys, ckpt, tmp_path):
    _, step_dir = ckpt
    path = os.path.join(step_dir, MODEL_1)
    shutil.move(path, tmp_path / "elsewhere.safetensors")  # the same bytes: checksums pass
    os.symlink(tmp_path / "elsewhere.safetensors", path)
    what = "is a symbolic link (a checkpoint holds regular files only)"
    assert verify_lines(capsys, step_dir) == [f"{path}: {what}"]
    assert refused(read_full_model, step_dir, read_manifest(step_dir)) == f"{path}: {what}"
    assert refused(check_intact, step_dir) == f"{path}: {what}"


def test_a_symlinked_directory_inside_the_step_dir(capsys, ckpt, tmp_path):
    _, step_dir = ckpt
    shutil.move(os.path.join(step_dir, "rng"), tmp_path / "rng")
    os.symlink(tmp_path / "rng", os.path.join(step_dir, "rng"))
    line = f"{step_dir}/{rng_file(0)}: lies outside the step directory (through a symbolic link)"
    assert verify_lines(capsys, step_dir) == [line]
    assert refused(member, step_dir, read_manifest(step_dir), rng_file(0)) == line


def test_a_param_file_no_checksum_covers(capsys, ckpt):
    _, step_dir = ckpt
    shutil.copy(os.path.join(step_dir, MODEL_1), os.path.join(step_dir, "extra-model.safetensors"))
    _point_param_at(step_dir, "extra-model.safetensors")
    what = f"is not listed in {MANIFEST}'s files, so no checksum covers it"
    assert verify_lines(capsys, step_dir)[0] == (
        f"{step_dir}/extra-model.safetensors: {what}; params['{NORM}'] names it"
    )
    assert refused(read_full_model, step_dir, read_manifest(step_dir)) == (
        f"{step_dir}/extra-model.safetensors: {what}"
    )


def test_an_optimizer_file_no_checksum_covers(capsys, ckpt):
    _, step_dir = ckpt
    manifest = manifest_of(step_dir)
    del manifest["files"][OPTIM_1]
    recommit(step_dir, manifest)
    assert verify_lines(capsys, step_dir) == [
        f"{step_dir}/{OPTIM_1}: is not listed in {MANIFEST}'s files (it holds the optimizer state "
        f"of {MODEL_1})"
    ]
    expected = expected_tensors(read_manifest(step_dir))
    assert refused(tensor_file, step_dir, read_manifest(step_dir), expected, OPTIM_1) == (
        f"{step_dir}/{OPTIM_1}: is not listed in {MANIFEST}'s files, so no checksum covers it"
    )


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (lambda e: e.pop("sha256"), "its entry in the manifest's files has no 'sha256'"),
        (
            lambda e: e.update(bytes="12"),
            "'bytes' of its entry in the manifest's files is '12', expected a non-negative integer",
        ),
    ],
    ids=["no sha256", "bytes a string"],
)
def test_a_malformed_files_entry(capsys, ckpt, edit, what):
    _, step_dir = ckpt
    manifest = manifest_of(step_dir)
    edit(manifest["files"][MODEL_1])
    reseal(step_dir, manifest)
    assert verify_lines(capsys, step_dir) == [f"{step_dir}/{MODEL_1}: {what}"]
    assert refused(read_manifest, step_dir) == f"{step_dir}/{MODEL_1}: {what}"


@pytest.mark.parametrize("rel", [".", "rng/./rank_00000.json", "rng/rank\x00.json", ""])
def test_a_files_entry_that_is_not_a_plain_path(capsys, ckpt, rel):
    _, step_dir = ckpt
    manifest = manifest_of(step_dir)
    manifest["files"][rel] = manifest["files"][rng_file(0)]
    reseal(step_dir, manifest)
    shown = rel.replace("\x00", "\\x00")
    line = f"{os.path.join(step_dir, shown)}: is not a plain relative path"
    assert verify_lines(capsys, step_dir) == [line]
    assert refused(member, step_dir, manifest, rel) == line
    assert cli.main(["ckpt", "inspect", step_dir]) == 1
    out, _ = capsys.readouterr()
    assert out.count("\n") == 8 + 1 + 18 + 2, out  # summary, "files", 18 rows, total, verdict


MANIFEST_EDITS = {
    "params entry without shape": (
        lambda m: m["params"][NORM].pop("shape"),
        f"params['{NORM}'] has no 'shape'",
    ),
    "params entry with a string shape": (
        lambda m: m["params"][NORM].update(shape="64"),
        f"'shape' of params['{NORM}'] is '64', expected a list of non-negative integers",
    ),
    "params entry without file": (
        lambda m: m["params"][NORM].pop("file"),
        f"params['{NORM}'] has no 'file'",
    ),
    "params entry with an unknown dtype": (
        lambda m: m["params"][NORM].update(dtype="F33"),
        f"'dtype' of params['{NORM}'] is 'F33', expected a safetensors dtype",
    ),
    "no trainer": (lambda m: m.pop("trainer"), "the manifest has no 'trainer'"),
    "trainer without lr": (lambda m: m["trainer"].pop("lr"), "trainer has no 'lr'"),
    "fp16 loss scaler not an object": (
        lambda m: m["trainer"].update(loss_scaler=65536),
        "'loss_scaler' of trainer is 65536, expected an object or null",
    ),
    "step as a string": (
        lambda m: m.update(step="10"),
        f"'step' of the manifest is '10', expected {STEP_RANGE}",
    ),
    # trainer numbers a resume would take as they are: refused by name, with the valid range
    "step beyond a step directory's name": (
        lambda m: m.update(step=10**12),
        f"'step' of the manifest is 1000000000000, expected {STEP_RANGE}",
    ),
    "lr NaN": (
        lambda m: m["trainer"].update(lr=float("nan")),
        "'lr' of trainer is nan, expected a finite number >= 0",
    ),
    "lr negative": (
        lambda m: m["trainer"].update(lr=-0.001),
        "'lr' of trainer is -0.001, expected a finite number >= 0",
    ),
    "beta of 1": (
        lambda m: m["trainer"].update(betas=[0.9, 1.0]),
        "'betas' of trainer is [0.9, 1.0], expected null or two numbers in [0, 1)",
    ),
    "scheduler far before its start": (
        lambda m: m["trainer"].update(lr_scheduler={"last_batch_iteration": -(10**9)}),
        "'last_batch_iteration' of trainer.lr_scheduler is -1000000000, expected an integer in "
        f"[-1, {MAX_STEP}]",
    ),
    "scheduler state without its position": (
        lambda m: m["trainer"].update(lr_scheduler={"last_epoch": 3}),
        "trainer.lr_scheduler has no 'last_batch_iteration'",
    ),
    "fp16 loss scale infinite": (
        lambda m: m["trainer"].update(loss_scaler={"cur_scale": float("inf"), "cur_iter": 3}),
        "'cur_scale' of trainer.loss_scaler is inf, expected a finite number > 0",
    ),
    "fp16 loss scaler iteration negative": (
        lambda m: m["trainer"].update(loss_scaler={"cur_scale": 2.0, "cur_iter": -4}),
        "'cur_iter' of trainer.loss_scaler is -4, expected a non-negative integer",
    ),
    "topology without pp": (lambda m: m["topology"].pop("pp"), "topology has no 'pp'"),
    "optim_keys not a list": (
        lambda m: m.update(optim_keys="exp_avg"),
        "'optim_keys' of the manifest is 'exp_avg', expected a list of strings",
    ),
    "params a list": (
        lambda m: m.update(params=[]),
        "'params' of the manifest is [], expected an object",
    ),
    "model with an unknown key": (
        lambda m: m["model"].update(heads=4),
        "model has 'heads', which is not a dsnd model setting",
    ),
    "model without config (nor the shape before configs)": (
        lambda m: m["model"].pop("config"),
        "model has no 'config'",
    ),
    "model with an unknown family": (
        lambda m: m["model"].update(family="bert"),
        f"'family' of model is 'bert', expected one of {', '.join(f.name for f in FAMILIES)}",
    ),
    "model config with an unknown key": (
        lambda m: m["model"]["config"].update(heads=4),
        "model.config: heads=4: not a LlamaConfig setting, so "
        "dsnd cannot tell what it does to the model",
    ),
    "model config without vocab_size": (
        lambda m: m["model"]["config"].pop("vocab_size"),
        "model.config has no 'vocab_size'",
    ),
    "model config with a string vocab_size": (
        lambda m: m["model"]["config"].update(vocab_size="256"),
        "'vocab_size' of model.config is '256', expected a positive integer",
    ),
    "model from before configs without vocab_size": (
        lambda m: m.update(
            model={k: v for k, v in LEGACY_MODEL["llama-tiny"].items() if k != "vocab_size"}
        ),
        "model has no 'vocab_size'",
    ),
    "model from before configs with an unknown key": (
        lambda m: m.update(model={**LEGACY_MODEL["llama-tiny"], "heads": 4}),
        "model has 'heads', which is not a dsnd model setting",
    ),
    "corpus without sha256": (lambda m: m["corpus"].pop("sha256"), "corpus has no 'sha256'"),
}


@pytest.mark.parametrize("case", MANIFEST_EDITS)
def test_a_missing_or_mistyped_manifest_key(capsys, ckpt, case):
    root, step_dir = ckpt
    edit, what = MANIFEST_EDITS[case]
    manifest = manifest_of(step_dir)
    edit(manifest)
    reseal(step_dir, manifest)
    line = f"{step_dir}/{MANIFEST}: {what}"
    assert verify_lines(capsys, step_dir) == [line]
    assert refused(read_manifest, step_dir) == line
    rc = cli.main(["ckpt", "inspect", root])  # still shows what it can
    out, err = capsys.readouterr()
    assert (rc, err) == (1, "") and "NOT INTACT: 1 problem(s)" in out


def _set_dtype(header: dict) -> None:
    header[NORM]["dtype"] = "I32"  # 4 bytes per element too: the data area still fits


def _transpose(header: dict) -> None:
    header[GATE]["shape"] = header[GATE]["shape"][::-1]


def _shift(header: dict) -> None:
    header[NORM]["data_offsets"] = [10**6 + x for x in header[NORM]["data_offsets"]]


def _add_extra(path: str) -> None:
    tensors = load_file(path)
    save_file({**tensors, "layers.1.smug\ngled": torch.zeros(3)}, path)


def _length(path: str, length: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path) if length is None else length))


HEADER_EDITS = {
    "dtype F32 -> I32": (
        lambda p: edit_header(p, _set_dtype),
        f"{NORM} is I32, {MANIFEST} says F32",
    ),
    "shape transposed": (
        lambda p: edit_header(p, _transpose),
        f"{GATE} has shape [64, 176], {MANIFEST} says [176, 64]",
    ),
    "an extra tensor": (
        _add_extra,
        f"holds layers.1.smug\\ngled, which {MANIFEST} does not list for it",
    ),
    "header length past the end": (
        _length,
        "header length {size} does not fit the file's {size} bytes (limit 104857600)",
    ),
    "header length short": (
        lambda p: _length(p, 16),
        "header is not valid JSON (Unterminated string starting at: line 1 column 2 (char 1))",
    ),
    "data_offsets past the data": (
        lambda p: edit_header(p, _shift),
        f"{NORM}: data_offsets [1000000, 1000256] end past the data area",
    ),
}


@pytest.mark.parametrize("case", HEADER_EDITS)
def test_a_header_edited_with_its_checksum_recomputed(capsys, ckpt, tmp_path, case):
    root, step_dir = ckpt
    path = os.path.join(step_dir, MODEL_1)
    damage, what = HEADER_EDITS[case]
    damage(path)
    recommit(step_dir, manifest_of(step_dir))
    what = what.format(size=os.path.getsize(path))
    lines = verify_lines(capsys, step_dir)
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {what}"), lines
    assert refused(read_full_model, step_dir, read_manifest(step_dir)).startswith(f"{path}: {what}")
    rc = cli.main(["ckpt", "export", root, str(tmp_path / "hf")])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "") and err.startswith(f"dsnd: error: {path}: {what}"), err
    assert not (tmp_path / "hf").exists()


def test_generate_refuses_f32_read_as_i32_in_a_real_process(ckpt):
    root, step_dir = ckpt
    path = os.path.join(step_dir, MODEL_1)
    edit_header(path, _set_dtype)
    recommit(step_dir, manifest_of(step_dir))
    proc = run_cli(["generate", root, "--prompt", "def", "--tokens", "2"], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dsnd: error: {path}: {NORM} is I32, {MANIFEST} says F32"
    )


@pytest.mark.parametrize(("rel", "value"), [(MODEL_1, float("nan")), (OPTIM_1, float("inf"))])
def test_non_finite_values(capsys, ckpt, rel, value):
    _, step_dir = ckpt
    path = os.path.join(step_dir, rel)
    tensors = load_file(path)
    name = sorted(tensors)[-1]
    tensors[name][0] = value
    save_file(tensors, path)
    recommit(step_dir, manifest_of(step_dir))
    line = f"{path}: holds non-finite values: {name}"
    assert verify_lines(capsys, step_dir) == [line]
    assert refused(check_intact, step_dir) == line


def test_nan_in_a_real_process_verify(ckpt):
    root, step_dir = ckpt
    path = os.path.join(step_dir, MODEL_1)
    tensors = load_file(path)
    tensors[NORM][3] = float("nan")
    tensors[GATE][0, 0] = float("-inf")
    save_file(tensors, path)
    recommit(step_dir, manifest_of(step_dir))
    proc = run_cli(["ckpt", "verify", root], timeout=300)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr[-2000:]
    assert proc.stderr == f"{path}: holds non-finite values: {NORM} (and 1 more tensor)\n"


def test_latest_is_a_directory(capsys, ckpt):
    root, _ = ckpt
    os.remove(os.path.join(root, "latest"))
    os.mkdir(os.path.join(root, "latest"))
    lines = verify_lines(capsys, root, rc=2)
    assert lines == [f"dsnd: error: {root}/latest: is not a regular file"]
    assert refused(check_root, root).startswith(f"{root}/latest: is not a regular file")


def test_a_symlinked_step_directory(capsys, ckpt, tmp_path):
    root, step_dir = ckpt
    other = tmp_path / "other"
    other.mkdir()
    link = other / step_dir_name(STEP)
    os.symlink(step_dir, link)
    (other / "latest").write_text(step_dir_name(STEP) + "\n")
    what = "is a symbolic link; give the step directory itself (a load reads only real directories)"
    assert verify_lines(capsys, str(other), rc=2) == [f"dsnd: error: {link}: {what}"]
    assert verify_lines(capsys, str(link), rc=2) == [f"dsnd: error: {link}: {what}"]
    assert refused(check_root, str(other)).startswith(f"{link}: is a symbolic link")


def test_a_symlinked_manifest(capsys, ckpt, tmp_path):
    _, step_dir = ckpt
    path = os.path.join(step_dir, MANIFEST)
    shutil.move(path, tmp_path / MANIFEST)
    os.symlink(tmp_path / MANIFEST, path)
    assert verify_lines(capsys, step_dir) == [f"{path}: is not a regular file"]


def test_rng_state_that_is_not_dsnd_s(tmp_path):
    path = tmp_path / "rank_00000.json"
    path.write_text('{"torch": [1, 2]}')
    message = refused(_restore_rng, str(path))
    assert message.startswith(f"{path}: not the RNG state dsnd saves (")
