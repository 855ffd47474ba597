"""`dsnd train` / `dsnd launch` refuse bad data, bad checkpoint roots and bad ports through the
real CLI entry (in-process): exit 2, one line on stderr, no process group, nothing saved lost."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch.distributed as dist

from dsnd import cli
from dsnd.data.token_file import write_token_file
from tests.unit.test_checkpoint_layout import save


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSND_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.chdir(tmp_path)


def refused(capsys, *argv: str) -> str:
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsnd: error: "), err
    assert not dist.is_initialized()
    return lines[0].removeprefix("dsnd: error: ")


def train(*sets: str) -> list[str]:
    return ["train", *(a for s in ("log.tensorboard=false", *sets) for a in ("--set", s))]


def test_data_the_model_cannot_read(capsys, tmp_path):
    assert refused(capsys, *train("model.vocab_size=100")) == (
        "data.path=null (the Python standard library's sources): byte tokens have ids up to "
        "255 >= model.vocab_size 100 (set model.vocab_size to at least 256)"
    )
    path = str(tmp_path / "t.bin")
    write_token_file(path, np.arange(100), 256, "byte", "test")
    with open(path + ".json") as f:
        meta = json.load(f)
    with open(path + ".json", "w") as f:
        json.dump({**meta, "dtype": "float32"}, f)
    assert refused(capsys, *train(f"data.path={path}")).startswith(
        f"{path}.json: dtype 'float32' is not a token id type"
    )
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": "\\ud800"}\n')
    assert refused(capsys, *train(f"data.path={jsonl}")).startswith(
        f"{jsonl}:2: field 'text' holds a lone surrogate"
    )


def test_checkpoint_roots_a_save_would_die_on(capsys, tmp_path):
    root = tmp_path / "ck"
    step = save(str(root), 2)
    os.remove(root / "latest")
    (root / "latest").mkdir()
    assert refused(capsys, *train(f"checkpoint.dir={root}")).startswith(
        f"{root}/latest: is not a regular file"
    )
    os.rmdir(root / "latest")
    os.symlink(step, root / "step_00000004")
    assert refused(capsys, *train(f"checkpoint.dir={root}")).startswith(
        f"{root}/step_00000004: is a symbolic link"
    )
    assert sorted(os.listdir(step)) == ["layer_000-model.safetensors", "manifest.json",
                                        "manifest.sha256", "rng"]  # fmt: skip


def test_a_named_checkpoint_holding_nan_is_refused(capsys, tmp_path):
    step = save(str(tmp_path / "ck"), 2, value=float("nan"))
    assert refused(capsys, *train(f"checkpoint.resume={step}")) == (
        f"{step}/layer_000-model.safetensors: holds non-finite values: layers.0.w"
    )


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_master_port_out_of_range(capsys, port):
    assert refused(capsys, "launch", "--nprocs", "2", "--master-port", port, "--dry-run") == (
        f"--master-port must be in 1..65535, got {port}"
    )


def test_an_export_directory_that_cannot_be_written(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "hf"
    assert refused(capsys, *train(f"checkpoint.export_hf={target}")) == (
        f"checkpoint.export_hf {target} is not writable (Not a directory); nothing was started"
    )
