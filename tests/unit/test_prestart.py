"""`dsnd train` / `dsnd launch` refuse bad data, bad checkpoint roots and bad ports through the
real CLI entry (in-process): exit 2, one line on stderr, no process group, nothing saved lost."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch.distributed as dist

from dsnd import cli
from dsnd.data.token_writer import write_token_file
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
    assert sorted(os.listdir(step)) == [
        "layer_000-model.safetensors",
        "manifest.json",
        "manifest.sha256",
        "rng",
    ]


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


def _export(path, root, step: int = 2) -> None:
    """An export dsnd wrote at `path` for the run whose checkpoint root is `root`."""
    from dsnd.model.hf_io import ExportOrigin, write_hf_dir
    from dsnd.model.stack import build_model
    from tests.models import spec_of

    spec = spec_of("llama-tiny")
    write_hf_dir(
        str(path),
        spec,
        build_model(spec, seed=0).state_dict(),
        origin=ExportOrigin(str(root), step),
    )


def test_an_export_directory_holding_what_dsnd_did_not_write(capsys, tmp_path):
    """Refused before anything starts (and by a dry run), nothing in it touched; an earlier
    export of the same run is fine (the export at the end replaces it whole)."""
    target, root, other = tmp_path / "hf", tmp_path / "ck", tmp_path / "other"
    target.mkdir()
    (target / "config.json").write_text("{}")
    sets = (f"checkpoint.dir={root}", f"checkpoint.export_hf={target}")
    assert refused(capsys, *train(*sets)) == (
        f"checkpoint.export_hf={target}: holds config.json and no dsnd-export.json, so it is not "
        "an export dsnd wrote; name a new or empty directory (dsnd replaces only its own earlier "
        "export of the same run)"
    )
    assert os.listdir(target) == ["config.json"]
    os.remove(target / "config.json")
    _export(target, other)
    dry_run = ["launch", "--nprocs", "1", "--dry-run", *(a for s in sets for a in ("--set", s))]
    assert refused(capsys, *dry_run) == (
        f"checkpoint.export_hf={target}: holds dsnd's export of another run (checkpoint root "
        f"{other}, step 2); this run's is {root}: name another directory, or remove that export"
    )
    shutil.rmtree(target)
    _export(target, root)
    assert cli.main(dry_run) == 0


def test_an_export_directory_holding_the_runs_own_directories(capsys, tmp_path):
    """The swap replaces the export's directory whole: log.dir or the checkpoint root in it
    would go too (found before the start; at the end of the run they already hold files)."""
    logs = tmp_path / "run"
    assert refused(capsys, *train(f"log.dir={logs}", f"checkpoint.export_hf={logs}")) == (
        f"checkpoint.export_hf={logs}: holds log.dir {logs} (an export replaces its directory "
        "whole); name a directory of its own"
    )
    ck = tmp_path / "ck"
    assert refused(capsys, *train(f"checkpoint.dir={ck}", f"checkpoint.export_hf={ck}")) == (
        f"checkpoint.export_hf={ck}: holds checkpoint.dir {ck} (an export replaces its directory "
        "whole); name a directory of its own"
    )
