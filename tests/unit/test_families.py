"""Every family and every shipped preset, at reduced width (same hyperparameters otherwise),
is the model `transformers` builds from the same directory: logits within 1e-5 (fp32) through
dsnd's own init_from loader, and the exported directory reloads to the same logits. Also the
real sizes' exact parameter counts (on the meta device) and the refusals of what dsnd cannot
honour."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsnd.errors import UserError
from dsnd.model import build_model, from_hf_state_dict
from dsnd.model.count import layer_table
from dsnd.model.hf_io import check_init_from, load_hf_stage, write_hf_dir
from dsnd.model.source import PRESET_DIR, check_model, load_model, presets
from tests.models import random_hf_model, spec_of

torch.set_num_threads(1)

# published totals (embedding and a tied head counted once), as transformers counts them
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    # mixtures of experts: every expert counted (Mixtral-8x7B's "46.7B", Qwen3-30B-A3B's "30.5B",
    # Qwen1.5-MoE-A2.7B's "14.3B")
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
}


def reduced(name: str) -> dict:
    """Shape overrides shrinking preset `name` to 2 blocks of width 64 (rope, norms, biases,
    tying, activations: unchanged)."""
    spec = spec_of(name)
    heads = 4
    kv = heads if spec.num_kv_heads == spec.num_heads else 2
    shape = dict(hidden_size=64, num_layers=2, num_heads=heads, ffn_size=96, vocab_size=320)
    if spec.family.name != "gpt2":
        shape["num_kv_heads"] = kv
    return shape


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", presets())
def test_preset_at_reduced_width_is_the_transformers_model(name, tmp_path):
    spec = spec_of(name, **reduced(name))
    hf = random_hf_model(spec)
    hf.save_pretrained(tmp_path / "user")  # random weights, as a user's directory
    user = str(tmp_path / "user")

    mine = load_model(user, "model.config")  # the directory alone defines the model
    assert mine.family is spec.family and mine.math() == spec.math()
    check_model(mine, 24, mine.source)
    check_init_from(user, mine)
    stack = build_model(mine, seed=9).eval()
    load_hf_stage(stack, user, mine)
    ids = _ids(mine.vocab_size)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = stack(ids)
    assert (got - want).abs().max().item() < 1e-5

    write_hf_dir(str(tmp_path / "out"), mine, stack.state_dict())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(input_ids=ids).logits - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_size_parameter_count_is_exact(name):
    assert sum(n for _, _, n in layer_table(spec_of(name))) == PUBLISHED[name]


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_in_the_4x_form_is_honoured(scaling, tmp_path):
    """A config.json as transformers 4.x wrote it (rope_theta, rope_scaling) through
    model.config: the same logits as transformers' model of that file."""
    raw = json.loads(open(os.path.join(PRESET_DIR, "llama-tiny.json")).read())
    raw.pop("rope_parameters")
    raw.update(rope_theta=50000.0, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = load_model(str(tmp_path), "model.config")
    assert spec.config.rope_parameters["rope_type"] == scaling["rope_type"]
    assert spec.config.rope_parameters["rope_theta"] == 50000.0
    hf = random_hf_model(spec)
    stack = build_model(spec, seed=1).eval()
    stack.load_state_dict(from_hf_state_dict(hf.state_dict(), spec), strict=True)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (stack(ids) - hf(input_ids=ids).logits).abs().max().item() < 1e-5


def _dir(tmp_path, name: str, **changes) -> str:
    raw = json.loads(open(os.path.join(PRESET_DIR, f"{name}.json")).read())
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("preset", "changes", "seq_len", "message"),
    [
        (
            "mistral-7b",
            {"sliding_window": 16},
            64,
            r"sliding_window=16: shorter than model.seq_len=64",
        ),
        ("gpt2", {"resid_pdrop": 0.1}, 64, r"resid_pdrop=0.1: dsnd trains without dropout"),
        ("llama-3.2-1b", {"attention_dropout": 0.1}, 64, r"attention_dropout=0.1"),
        ("llama-3.2-1b", {"hidden_act": "swishy"}, 64, r"hidden_act='swishy': not an activation"),
        ("gpt2", {}, 2048, r"model.seq_len=2048 must be in 1..1024, the max_position_embeddings"),
        (
            "mixtral-8x7b",
            {"router_jitter_noise": 0.01},
            64,
            r"router_jitter_noise=0.01: dsnd trains without random router noise",
        ),
        ("mixtral-8x7b", {"num_experts_per_tok": 9}, 64, r"num_experts_per_tok=9: must be in 1..8"),
    ],
    ids=[
        "window",
        "gpt2-dropout",
        "llama-dropout",
        "activation",
        "seq-len",
        "router-noise",
        "top-k",
    ],
)
def test_what_cannot_be_honoured_is_refused_by_field_and_value(
    tmp_path, preset, changes, seq_len, message
):
    spec = load_model(_dir(tmp_path, preset, **changes), "model.config")
    with pytest.raises(UserError, match=message):
        check_model(spec, seq_len, spec.source)


def test_a_window_at_least_the_sequence_is_honoured(tmp_path):
    spec = load_model(_dir(tmp_path, "mistral-7b", sliding_window=4096), "model.config")
    check_model(spec, 4096, spec.source)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
            r"architecture \['GemmaForCausalLM'\] is not supported; dsnd trains LlamaForCausalLM, "
            r"GPT2LMHeadModel, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
            r"MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM",
        ),
        ({"use_mrope": True}, r"use_mrope=True: not a Qwen2Config setting"),
        ({"my_new_trick": 3}, r"my_new_trick=3: not a Qwen2Config setting, so dsnd cannot tell"),
    ],
    ids=["architecture", "mrope", "unknown-key"],
)
def test_a_config_dsnd_cannot_read_whole_is_refused(tmp_path, changes, message):
    with pytest.raises(UserError, match=message):
        load_model(_dir(tmp_path, "qwen2.5-0.5b", **changes), "model.config")


def test_nothing_is_downloaded():
    with pytest.raises(
        UserError,
        match=r"not a preset .* nor a local directory or config.json "
        r"\(dsnd never downloads models\)",
    ):
        load_model("meta-llama/Llama-3.2-1B", "model.config")
