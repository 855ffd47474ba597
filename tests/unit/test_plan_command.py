"""``dsnd plan`` as a user runs it: the table, --json fields, --out files that ``dsnd launch``
takes as is, and one-line refusals."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from dsnd import cli

BASE = [
    "plan",
    "--model",
    "llama-tiny",
    "--world",
    "4",
    "--gpu",
    "h100",
    "--seq",
    "64",
    "--global-batch",
    "16",
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_header_and_explanation(capsys):
    code, out, _ = run(capsys, *BASE)
    assert code == 0
    assert "precision: bf16 mixed precision, Adam (K = 12" in out
    assert "batch: 16 sequences of 64 tokens per step" in out
    assert out.count("\n  ") >= 5  # five layouts ranked
    assert "accuracy: on 72 published h100 runs the measured MFU was 0.79-1.12x" in out
    assert "MFU (range)" in out and any(
        " + optim " in line and line.endswith(" GiB") for line in out.splitlines()
    )  # memory in words
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    assert "s/step" in best and "GiB per device" in best and "going by published runs" in best
    reasons = (" because ", " ties with ", ", narrowly: ")  # a tie is not given as a reason
    for knob in ("pp=", "zero=", "micro-batch=", "checkpointing=", "schedule="):
        assert any(
            line.startswith(knob) and any(r in line for r in reasons) for line in out.splitlines()
        )


def test_json_has_every_field_the_issue_names(capsys):
    code, out, _ = run(capsys, *BASE, "--json", "--all")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"layouts", "validation"} and doc["validation"] == []
    fields = {
        "pp",
        "tp",
        "dp",
        "cp",
        "zero_stage",
        "micro_batch",
        "activation_checkpointing",
        "schedule",
        "params_count",
        "memory_bytes",
        "step_time_s",
        "fits",
        "deepspeed_estimate_bytes",
    }
    for lay in doc["layouts"]:
        assert fields <= set(lay)
        assert set(lay["memory_bytes"]) == {
            "params",
            "grads",
            "optimizer",
            "activations",
            "buffers",
        }
        assert lay["params_count"] == 217664  # llama-tiny, counted on the meta device
        assert (lay["deepspeed_estimate_bytes"] is None) == (lay["zero_stage"] < 2)


def test_all_lists_layouts_that_do_not_fit(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "llama-3.1-70b",
        "--world",
        "8",
        "--gpu",
        "a100",
        "--json",
        "--all",
        "--fix",
        "micro_batch=1",
    )
    assert code == 0
    layouts = json.loads(out)["layouts"]
    assert any(not x["fits"] for x in layouts)
    # 70B in bf16 with Adam needs 16 bytes per parameter: 1.1 TB, more than 8 x 80 GiB at any
    # ZeRO stage, so nothing fits and every layout is listed with fits false
    assert not any(x["fits"] for x in layouts)


def test_out_writes_files_dsnd_launch_takes_as_is(capsys, tmp_path):
    out_dir = tmp_path / "plan"
    code, out, _ = run(capsys, *BASE, "--out", str(out_dir))
    assert code == 0 and "wrote" in out
    run_yaml = yaml.safe_load((out_dir / "run.yaml").read_text())
    ds = json.loads((out_dir / "ds_config.json").read_text())
    assert run_yaml["deepspeed"] == "ds_config.json"
    assert ds["train_batch_size"] == 16 and ds["bf16"] == {"enabled": True}
    p = run_yaml["parallel"]
    dp = 4 // (p["pp"] * p["tp"] * p["cp"])
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp == 16
    code, out, err = run(
        capsys,
        "launch",
        "--config",
        str(out_dir / "run.yaml"),
        "--nprocs",
        "4",
        "--dry-run",
        "--json",
    )
    assert code == 0, err
    launched = json.loads(out)
    assert launched["world_size"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "b200"], "--gpu 'b200' is not a known device"),
        (["--gpu-mem", "80"], "without --gpu, plan needs --gpu-flops, --intra-bw, --inter-bw"),
        (["--gpu", "h100", "--fix", "pq=2"], "--fix 'pq=2': expected KNOB=VALUE"),
        (["--gpu", "h100", "--fix", "pp=3"], "no layout of world 4 runs llama-tiny"),
        (["--gpu", "h100", "--seq", "100000"], "--seq 100000 must be 1.."),
        (["--gpu", "h100", "--validate"], "--validate runs the layouts on this machine"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, _, err = run(capsys, "plan", "--world", "4", *argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def test_out_refuses_a_directory_that_holds_anything(capsys, tmp_path):
    """The user's own run.yaml and ds_config.json in --out are not overwritten: a directory
    holding anything (or a file in its place) is one line and exit 2, and stays as it was."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "run.yaml").write_text("my: run\n")
    (mine / "notes.txt").write_text("keep\n")
    code, _, err = run(capsys, *BASE, "--out", str(mine))
    assert code == 2 and err == (
        f"dsnd: error: --out {mine}: holds notes.txt, run.yaml; dsnd "
        "plan writes run.yaml and ds_config.json into a new or empty "
        "directory only (nothing is overwritten): name another one, or "
        "remove what is there\n"
    )
    assert sorted(os.listdir(mine)) == ["notes.txt", "run.yaml"]
    assert (mine / "run.yaml").read_text() == "my: run\n"
    code, _, err = run(capsys, *BASE, "--out", str(mine / "notes.txt"))
    assert code == 2 and err == (
        f"dsnd: error: --out {mine}/notes.txt: exists and is not a directory\n"
    )
