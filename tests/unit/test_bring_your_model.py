"""A user's own model directory through the real CLI (in-process): `dsnd model show/list`, and
before any process group starts, `dsnd train` / `dsnd launch --dry-run` refuse (exit 2, one
line) a model.config dsnd cannot honour or an init_from that does not hold the run's model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dsnd import cli
from tests.models import spec_of
from tests.unit.test_prestart import isolated, refused  # noqa: F401  (the fixture)


def user_dir(path, preset: str = "mistral-7b", **config_changes):
    """A random-weight model directory, as save_pretrained writes it, of `preset` at width 64
    (rope_theta, norms and the rest as published), with `config_changes` in its config.json."""
    spec = spec_of(
        preset,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=96,
        vocab_size=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(spec.config, dtype=torch.float32).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(config_changes)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def sets(*items: str) -> list[str]:
    return [a for s in ("log.tensorboard=false", *items) for a in ("--set", s)]


def test_model_show_counts_a_real_size_exactly_without_allocating_it(capsys):
    assert cli.main(["model", "show", "llama-3.1-70b"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 70,553,706,496\n" in out
    assert "    1  LlamaBlock                         855,654,400\n" in out
    assert cli.main(["model", "list"]) == 0
    assert "qwen3-0.6b       qwen3        596,049,920 parameters  28 layers, hidden 1024\n" in (
        capsys.readouterr().out
    )


def test_model_show_of_a_users_directory(capsys, tmp_path):
    path = user_dir(tmp_path / "m")
    capsys.readouterr()
    assert cli.main(["model", "show", path]) == 0
    out = capsys.readouterr().out
    assert f"model: mistral ({path}): hidden 64, 2 layers, 4 heads (2 kv), vocab 256" in out
    assert "'rope_theta': 1000000.0" in out


@pytest.mark.parametrize("command", ["train", "launch"])
def test_init_from_is_checked_before_start(capsys, tmp_path, command):
    head = ["launch", "--dry-run", "--nprocs", "1"] if command == "launch" else ["train"]
    mine = user_dir(tmp_path / "mine")
    other = user_dir(
        tmp_path / "other", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}
    )
    capsys.readouterr()  # save_pretrained's progress bars
    assert refused(capsys, *head, *sets(f"model.config={mine}", f"model.init_from={other}")) == (
        f"model.init_from={other}: config.json rope_parameters="
        "{'rope_theta': 10000.0, 'rope_type': 'default'} but the run's model "
        f"({mine}) has {{'rope_theta': 1000000.0, 'rope_type': 'default'}}"
    )
    weights = tmp_path / "mine" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    assert refused(capsys, *head, *sets(f"model.init_from={mine}")) == (
        f"model.init_from={mine}: the checkpoint has no model.layers.1.mlp.up_proj.weight "
        "(shape [96, 64])"
    )
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 32)
    save_file(tensors, weights)
    assert refused(capsys, *head, *sets(f"model.init_from={mine}")) == (
        f"model.init_from={mine}: model.layers.1.mlp.up_proj.weight has shape [96, 32] but the "
        "model's is [96, 64]"
    )


@pytest.mark.parametrize(
    ("changes", "extra", "message"),
    [
        (
            {"sliding_window": 32},
            (),
            "{path}: sliding_window=32: shorter than model.seq_len=64; dsnd runs full causal "
            "attention, so it would train another model (use seq_len <= 32)",
        ),
        (
            {"max_position_embeddings": 48},
            (),
            "model.seq_len=64 must be in 1..48, the max_position_embeddings of {path}; raise it "
            "with model.max_position_embeddings if the model may run longer sequences",
        ),
        (
            {"architectures": ["PhiForCausalLM"], "model_type": "phi"},
            (),
            "model.config={path}: architecture ['PhiForCausalLM'] is not supported; dsnd trains "
            "LlamaForCausalLM, GPT2LMHeadModel, MistralForCausalLM, Qwen2ForCausalLM, "
            "Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM",
        ),
        (
            {},
            ("model.preset=gpt2-tiny",),
            "model.config='{path}' and model.preset='gpt2-tiny' name two models; set one of them",
        ),
        ({}, ("parallel.tp=4",), "{path}: num_kv_heads=2 is not divisible by parallel.tp=4"),
        (
            {"rope_theta": 10000.0},
            (),
            "{path}/config.json: rope_theta=10000.0 disagrees with rope_parameters.rope_theta="
            "1000000.0; keep one of them",
        ),
    ],
    ids=["window", "positions", "architecture", "two-models", "tp", "two-ropes"],
)
def test_a_config_dsnd_cannot_honour_is_one_line(capsys, tmp_path, changes, extra, message):
    path = user_dir(tmp_path / "m", **changes)
    capsys.readouterr()  # save_pretrained's progress bars
    got = refused(
        capsys, "launch", "--dry-run", "--nprocs", "4", *sets(f"model.config={path}", *extra)
    )
    assert got == message.format(path=path)
