"""dsnd's forward-only path on pp=2 x tp=2 (4 real gloo ranks) gives the logits `transformers`
gives for the same model directory, within 1e-5 (fp32), for every family; Qwen2.5 (tied head,
q/k/v biases) also under sequence parallelism."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.logits_worker import IDS
from tests.models import random_hf_model, spec_of
from tests.procs import run_ranks

PRESETS = ("gpt2", "llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b")


def _user_dir(preset: str, path) -> torch.Tensor:
    """Save a random-weight reduced `preset` at `path`; its logits for IDS."""
    shape = dict(hidden_size=64, num_layers=4, num_heads=4, ffn_size=96, vocab_size=320)
    spec = spec_of(preset, **shape, **({} if preset == "gpt2" else {"num_kv_heads": 2}))
    hf = random_hf_model(spec)
    hf.save_pretrained(path)
    with torch.no_grad():
        return hf(input_ids=IDS).logits


@pytest.mark.dist
def test_pipeline_logits_equal_transformers(tmp_path):
    want, cases = {}, []
    for preset in PRESETS:
        want[preset] = _user_dir(preset, tmp_path / preset)
        sets = [f"model.init_from={tmp_path / preset}", "parallel.pp=2", "parallel.tp=2"]
        cases.append({"name": preset, "sets": sets})
    cases.append(
        {"name": "qwen2.5-0.5b-sp", "sets": [*cases[3]["sets"], "parallel.sequence_parallel=true"]}
    )
    want["qwen2.5-0.5b-sp"] = want["qwen2.5-0.5b"]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_ranks(
        4,
        [
            "tests/distributed/logits_worker.py",
            str(tmp_path / "out.json"),
            str(tmp_path / "cases.json"),
        ],
        timeout=400,
    )
    got = json.loads((tmp_path / "out.json").read_text())
    assert sorted(got) == sorted(want)
    for name, logits in got.items():
        diff = (torch.tensor(logits) - want[name]).abs().max().item()
        assert diff < 1e-5, (name, diff)
