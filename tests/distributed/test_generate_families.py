"""A user's model directory of each family, trained one step at lr 0 (so the weights stay the
directory's) with `model.init_from` alone, gives the same greedy tokens from its checkpoint as
`transformers`' own greedy `generate` of the original model on the same prompt ids; exports
carry the directory's tokenizer files."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch

from dsnd.cli import main
from dsnd.commands.generate import generate, load_checkpoint_model
from tests.distributed.parity import run_cases
from tests.models import random_hf_model, spec_of

PRESETS = (
    "gpt2",
    "llama-3.2-1b",
    "mistral-7b",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "mixtral-8x7b",
    "qwen3-moe-tiny",
)
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, ffn_size=96, vocab_size=320)
LR0 = (
    "ds.optimizer.params.lr=0",
    "ds.scheduler.params.warmup_min_lr=0",
    "ds.scheduler.params.warmup_max_lr=0",
)


def _user_dir(preset: str, path) -> Any:
    shape = dict(SHAPE) | ({} if preset == "gpt2" else {"num_kv_heads": 2})
    hf = random_hf_model(spec_of(preset, **shape))
    hf.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"marker": "' + preset + '"}')
    return hf


@pytest.mark.dist
def test_greedy_tokens_equal_transformers_generate(tmp_path):
    models, cases = {}, []
    for preset in PRESETS:
        models[preset] = _user_dir(preset, tmp_path / preset)
        cases.append(
            {
                "name": preset,
                "reference": False,
                "sets": [
                    f"model.init_from={tmp_path / preset}",
                    "train.steps=1",
                    "model.seq_len=32",
                    f"checkpoint.dir={tmp_path / 'ckpt' / preset}",
                    f"log.dir={tmp_path / 'log' / preset}",
                    f"checkpoint.export_hf={tmp_path / 'export' / preset}",
                    *LR0,
                ],
            }
        )
    run_cases(tmp_path, 1, cases)
    prompt = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119]])
    for preset, hf in models.items():
        model, spec = load_checkpoint_model(str(tmp_path / "ckpt" / preset))
        assert spec.source == str(tmp_path / preset)
        ours = generate(model, prompt, 12, spec.max_seq_len, 0.0, torch.Generator())
        with torch.no_grad():
            theirs = hf.generate(
                prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
            )
        assert ours.tolist() == theirs.tolist(), preset
        exported = tmp_path / "export" / preset
        assert "marker" in (exported / "tokenizer_config.json").read_text()
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            main(
                [
                    "generate",
                    str(tmp_path / "ckpt" / "gpt2"),
                    "--prompt",
                    "Hello, w",
                    "--tokens",
                    "12",
                    "--temperature",
                    "0",
                ]
            )
            == 0
        )
    assert len(out.getvalue()) > len("Hello, w")
    assert os.path.isdir(tmp_path / "ckpt" / "gpt2")
