"""What ``dsnd plan --out`` writes for ZeRO: GPU plans sized to the model (Hugging Face's "auto"
formulas of the hidden size) with DeepSpeed's own Adam; plans for this CPU keep the packaged
test sizes; never `torch_adam` beside an offloaded optimizer; the packaged JSONs untouched."""

from __future__ import annotations

import json
import pathlib

import pytest

from dsnd import cli
from dsnd.config.packaged import packaged_json
from dsnd.layout_search.zero_sizes import (
    TEST_BUCKET,
    drop_torch_adam_beside_offload,
    one_sub_group_per_stage,
    reduce_bucket,
    sized_hidden,
)

HIDDEN = 64  # llama-tiny
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _emitted(capsys, tmp_path, gpu: str, stage: int) -> dict:
    out = tmp_path / f"{gpu}-{stage}"
    code = cli.main(
        [
            "plan",
            "--model",
            "llama-tiny",
            "--world",
            "4",
            "--gpu",
            gpu,
            "--seq",
            "64",
            "--global-batch",
            "16",
            "--fix",
            f"zero_stage={stage}",
            "--out",
            str(out),
        ]
    )
    capsys.readouterr()
    assert code == 0
    return json.loads((out / "ds_config.json").read_text())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gpu_plan_is_sized_to_the_model_with_deepspeeds_adam(capsys, tmp_path, stage):
    ds = _emitted(capsys, tmp_path, "h100", stage)
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("reduce_bucket_size") == (HIDDEN * HIDDEN if stage else None)
    stage3 = {
        k: zero.get(k)
        for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    }
    want = [int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN] if stage == 3 else [None, None]
    assert list(stage3.values()) == want
    assert "torch_adam" not in ds["optimizer"]["params"]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_plan_for_this_cpu_keeps_the_packaged_test_sizes(capsys, tmp_path, stage):
    ds = _emitted(capsys, tmp_path, "cpu", stage)
    with open(packaged_json(stage), encoding="utf-8") as f:
        packaged = json.load(f)
    assert ds["zero_optimization"] == packaged["zero_optimization"]
    assert ds["optimizer"] == packaged["optimizer"]  # torch's AdamW: no offload, no JIT build


def test_the_packaged_and_test_jsons_keep_their_tiny_model_sizes():
    """Tests rely on them: persistence 0 makes ZeRO-3 shard a tiny model at all."""
    for folder in (ROOT / "ds_configs", pathlib.Path(packaged_json(3)).parent):
        zero3 = json.loads((folder / "zero3.json").read_text())["zero_optimization"]
        assert zero3["stage3_param_persistence_threshold"] == 0, folder
        assert zero3["reduce_bucket_size"] == TEST_BUCKET, folder


@pytest.mark.parametrize(
    ("offload", "kept"), [(None, True), ("none", True), ("cpu", False), ("nvme", False)]
)
def test_torch_adam_never_stays_beside_an_offloaded_optimizer(offload, kept):
    zero = {"stage": 2} | ({"offload_optimizer": {"device": offload}} if offload else {})
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
    }
    drop_torch_adam_beside_offload(ds)
    assert ("torch_adam" in ds["optimizer"]["params"]) is kept
    assert ds["optimizer"]["params"]["lr"] == 1e-4


def test_a_pipelined_zero3_plan_of_a_large_model_keeps_one_sub_group_per_stage():
    ds = {"zero_optimization": {"stage": 3}}
    one_sub_group_per_stage(ds, pp=2, params=8_000_000_000)
    assert ds["zero_optimization"]["sub_group_size"] == 8_000_000_000
    for stage, pp, params in ((3, 1, 8_000_000_000), (2, 2, 8_000_000_000), (3, 2, 10**6)):
        ds = {"zero_optimization": {"stage": stage}}
        one_sub_group_per_stage(ds, pp, params)
        assert "sub_group_size" not in ds["zero_optimization"]


def test_the_planner_charges_the_bucket_the_json_gets():
    assert reduce_bucket(sized_hidden("h100", 4096)) == 4096 * 4096
    assert reduce_bucket(sized_hidden("cpu", 4096)) == TEST_BUCKET
