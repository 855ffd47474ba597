"""`model.init_from` / `checkpoint.export_hf`: a transformers checkpoint in, the same model out.

HF weights (seeded, then perturbed so they are not dsnd's init) go into dsnd at pp=2 x dp=1 and
pp=1 x dp=2 (each stage reads its own tensors), come back out through `export_hf` (every stage
gathered to rank 0) and load with `AutoModelForCausalLM.from_pretrained`: the logits equal the
original's. One case trains a step first, so the export must differ: it reads the trained weights.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from dsnd.config.presets import PRESETS
from dsnd.errors import UserError
from dsnd.model.hf_io import check_hf_config
from dsnd.model import hf_config
from tests.dist.parity import run_cases


def _hf_model(preset: str) -> torch.nn.Module:
    torch.manual_seed(7)
    cls = LlamaForCausalLM if preset == "llama-tiny" else GPT2LMHeadModel
    model = cls(hf_config(PRESETS[preset])).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _case(name: str, preset: str, zero: int, src, out, steps: int, pp: int) -> dict:
    sets = [f"model.preset={preset}", f"deepspeed=ds_configs/zero{zero}.json", f"parallel.pp={pp}",
            f"train.steps={steps}", f"model.init_from={src}", f"checkpoint.export_hf={out}",
            f"log.dir=runs/test/{name}"]  # fmt: skip
    return {"name": name, "sets": sets}


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.dist
def test_hf_checkpoint_roundtrip_through_pipeline_stages(tmp_path):
    models, cases = {}, []
    for preset in ("llama-tiny", "gpt2-tiny"):
        models[preset] = _hf_model(preset)
        models[preset].save_pretrained(tmp_path / f"in-{preset}")
    plan = [
        # name, preset, ZeRO stage, train.steps, pp (dp = 2 / pp)
        ("llama-z0", "llama-tiny", 0, 0, 2),
        ("gpt2-z0", "gpt2-tiny", 0, 0, 2),
        ("gpt2-z3", "gpt2-tiny", 3, 0, 2),  # tied weight owned by stage 0, under ZeRO-3
        ("llama-z3", "llama-tiny", 3, 0, 2),
        ("llama-dp2-z3", "llama-tiny", 3, 0, 1),  # shards gathered over the data group
        ("llama-z0-trained", "llama-tiny", 0, 1, 2),
    ]
    for name, preset, zero, steps, pp in plan:
        src = tmp_path / f"in-{preset}"
        cases.append(_case(name, preset, zero, src, tmp_path / name, steps, pp))
    rows = run_cases(tmp_path, 2, cases)
    assert rows["llama-z0"] == [] and len(rows["llama-z0-trained"]) == 1
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    for name, preset, _, steps, _ in plan:
        exported, info = AutoModelForCausalLM.from_pretrained(
            tmp_path / name, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        assert type(exported) is type(models[preset]), name
        got, want = _logits(exported.eval(), tokens), _logits(models[preset], tokens)
        diff = (got - want).abs().max().item()
        if steps == 0:
            assert diff < 1e-5, (name, diff)
        else:  # training moved the weights, and the export saw it
            assert diff > 1e-3, (name, diff)
            before = models[preset].state_dict()
            changed = [k for k, v in exported.state_dict().items() if not torch.equal(v, before[k])]
            assert len(changed) == len(before), (name, sorted(set(before) - set(changed)))


def test_init_from_refuses_a_checkpoint_of_another_shape(tmp_path):
    hf_config(PRESETS["gpt2-tiny"]).save_pretrained(tmp_path)
    check_hf_config(str(tmp_path), PRESETS["gpt2-tiny"])
    with pytest.raises(UserError, match=r"n_head=4 .*num_key_value_heads=2"):
        check_hf_config(str(tmp_path), PRESETS["llama-tiny"])
