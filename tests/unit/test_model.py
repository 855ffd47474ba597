"""dsnd.model: parity with transformers, deterministic init, tying, parameter groups, exported
files' modes."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from dsnd.model import (
    LayerStack,
    build_model,
    layer_specs,
    lm_loss,
    param_groups,
)
from dsnd.model.hf_io import write_hf_dir
from dsnd.model.hf_weights import from_hf_state_dict, to_hf_state_dict
from dsnd.model.layer_spec import TiedLayerSpec
from dsnd.moe.router_aux import RouterAux
from tests.models import spec_of

torch.set_num_threads(1)


def _hf_model(dims, sd):
    model = AutoModelForCausalLM.from_config(dims.config, dtype=torch.float32).eval()
    model.load_state_dict(sd, strict=True)
    return model


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "mixtral-tiny", "qwen3-moe-tiny"])
def test_logits_match_transformers(preset):
    dims = spec_of(preset)
    model = build_model(dims, seed=0).eval()
    hf = _hf_model(dims, to_hf_state_dict(model, dims))
    ids = torch.randint(0, dims.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        ref = hf(input_ids=ids).logits
    assert ours.shape == (2, 64, dims.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-5
    # The loss is HF's own shifted loss once labels are shifted by the caller.
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        hf_loss = hf(input_ids=ids, labels=ids).loss
    assert torch.allclose(lm_loss(ours, labels), hf_loss, atol=1e-5)


MOE_SHAPES = {  # preset, config overrides, shape overrides
    "mixtral": ("mixtral-tiny", {}, {}),
    "qwen3_moe": ("qwen3-moe-tiny", {}, {}),  # layer 0 dense (mlp_only_layers), top-k renormalised
    "qwen2_moe": (
        "qwen1.5-moe-a2.7b",
        {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
        {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 4,
            "head_dim": 16,
            "ffn_size": 96,
            "vocab_size": 256,
        },
    ),  # shared expert,
}
"""(qwen2_moe: top-4 of 60 experts, unnormalised)"""


def moe_spec(family: str, overrides: dict | None = None):
    preset, config, shape = MOE_SHAPES[family]
    return spec_of(preset, {**config, **(overrides or {})}, **shape)


MOE = {family: moe_spec(family) for family in MOE_SHAPES}


AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # large: it must show


@pytest.mark.parametrize("aux", [False, True], ids=["no-aux", "aux"])
@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_training_step_is_transformers(family, aux):
    """In training mode: the same loss (relative 1e-5) and the same gradient of every tensor,
    routed experts and router included, as transformers' model with the same weights; with
    `output_router_logits` the loss includes the routers' load-balancing loss, as theirs does."""
    dims = moe_spec(family, AUX if aux else None)
    model = build_model(dims, seed=0).train()
    router_aux = RouterAux(model, dims.config) if aux else None
    hf = _hf_model(dims, to_hf_state_dict(model, dims)).train()
    ids = torch.randint(0, dims.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    ours = lm_loss(model(ids), labels)
    out = hf(input_ids=ids, labels=ids)
    if aux:
        extra = router_aux.loss(router_aux.partial(ids.device))
        assert abs(extra.item() - 0.5 * out.aux_loss.item()) <= 1e-6 and extra.item() > 0.4
        ours = ours + extra
    theirs = out.loss
    assert abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item()
    ours.backward()
    theirs.backward()
    grads = to_hf_state_dict(model, dims).keys()
    hf_params = dict(hf.named_parameters())
    ours_by_hf = dict(zip(grads, (p.grad for p in model.parameters()), strict=True))
    assert any(".experts." in n for n in ours_by_hf)
    for name, grad in ours_by_hf.items():
        want = hf_params[name].grad
        assert (grad - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item()), name


def test_causal():
    dims = spec_of("llama-tiny")
    model = build_model(dims, seed=0).eval()
    ids = torch.randint(0, dims.vocab_size, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % dims.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids)[0, :10], model(changed)[0, :10])


@pytest.mark.parametrize(
    "dims",
    [
        spec_of("llama-tiny"),
        spec_of("gpt2-tiny"),
        spec_of("llama-tiny", {"tie_word_embeddings": True}, num_layers=2),
        spec_of("gpt2-tiny", {"tie_word_embeddings": False}),
    ],
    ids=["llama", "gpt2", "llama-tied", "gpt2-untied"],
)
def test_hf_round_trip(dims):
    model = build_model(dims, seed=3)
    hf_sd = to_hf_state_dict(model, dims)
    back = from_hf_state_dict(hf_sd, dims)
    ours = model.state_dict()
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    # The HF model accepts every name, tied or not.
    _hf_model(dims, hf_sd)


def test_exported_weights_get_the_mode_the_umask_gives(tmp_path):
    dims = spec_of("llama-tiny")
    out = tmp_path / "hf"
    old = os.umask(0o027)  # not the usual 022: the mode must follow the umask, not a constant
    try:
        write_hf_dir(str(out), dims, build_model(dims, seed=3).state_dict())
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o640, "model.safetensors": 0o640, "dsnd-export.json": 0o640}
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # written in a temporary dir, renamed


def test_from_hf_rejects_unknown_names():
    dims = spec_of("llama-tiny")
    with pytest.raises(KeyError):
        from_hf_state_dict({"model.mystery.weight": torch.zeros(1)}, dims)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_init_depends_only_on_seed_index_name(preset):
    dims = spec_of(preset)
    specs = layer_specs(dims)
    full = build_model(dims, seed=7).state_dict()
    for indices in ([2], [3, len(specs) - 1], [len(specs) - 1]):
        part = LayerStack(specs, seed=7, layer_indices=indices)
        assert part.global_indices == tuple(indices)
        sd = part.state_dict()
        assert sd
        for name, tensor in sd.items():
            assert torch.equal(tensor, full[name]), name
    other = LayerStack(specs, seed=8, layer_indices=[2]).state_dict()
    assert all(not torch.equal(t, full[n]) for n, t in other.items() if t.ndim == 2)


def test_init_values():
    dims = spec_of("gpt2-tiny")
    sd = build_model(dims, seed=0).state_dict()
    assert torch.equal(sd["layers.1.ln_1.weight"], torch.ones(dims.hidden_size))
    assert torch.equal(sd["layers.1.attn.c_attn.bias"], torch.zeros(3 * dims.hidden_size))
    std = sd["layers.1.mlp.c_fc.weight"].std().item()
    assert abs(std - dims.config.initializer_range) < 0.002
    # Different layers and names draw different values.
    assert not torch.equal(sd["layers.1.attn.c_proj.weight"], sd["layers.2.attn.c_proj.weight"])


def test_gpt2_head_shares_embedding_parameter():
    dims = spec_of("gpt2-tiny")
    model = build_model(dims, seed=0)
    embed = model.tied_modules["embed"]
    assert len(model.tied_modules) == 1
    assert model.tied_weight_attrs == {"embed": ["wte.weight"]}
    (model(torch.randint(0, 256, (1, 8))).sum()).backward()
    # One Parameter, gradients from both uses (the embedding alone would touch only 8 rows).
    assert (embed.wte.weight.grad.abs().sum(dim=1) > 0).all()
    names = [n for n, _ in model.named_parameters()]
    assert names.count("tied_modules.embed.wte.weight") == 1
    # A stage with just the head builds its own copy of the same initial embedding.
    head_only = LayerStack(layer_specs(dims), seed=0, layer_indices=[dims.num_layers + 2])
    assert torch.equal(head_only.tied_modules["embed"].wte.weight, embed.wte.weight)


def test_layer_specs_shape():
    for preset in ("llama-tiny", "gpt2-tiny"):
        dims = spec_of(preset)
        specs = layer_specs(dims)
        assert len(specs) == dims.num_layers + 3
        tied = [s for s in specs if isinstance(s, TiedLayerSpec)]
        if dims.tie_embeddings:
            assert [specs.index(s) for s in tied] == [0, len(specs) - 1]
            assert tied[0].key == tied[1].key
            assert tied[0].forward_fn is None and tied[1].forward_fn is not None
        else:
            assert tied == []


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_param_groups(preset):
    dims = spec_of(preset)
    model = build_model(dims, seed=0)
    groups = param_groups(model)
    assert len(groups) == 2
    assert "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0
    decay = {id(p) for p in groups[0]["params"]}
    no_decay = {id(p) for p in groups[1]["params"]}
    all_params = list(model.parameters())
    assert len(decay) + len(no_decay) == len(all_params) == len(decay | no_decay)
    expected_no_decay = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            norm = isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower()
            if norm or name == "bias" or isinstance(module, nn.Embedding):
                expected_no_decay.add(id(p))
    assert no_decay == expected_no_decay
    assert all(p.ndim == 2 for p in groups[0]["params"])
    torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)  # accepted by an optimizer


def test_param_groups_drop_empty_group():
    dims = spec_of("llama-tiny")
    head = LayerStack(layer_specs(dims), seed=0, layer_indices=[dims.num_layers + 2])
    groups = param_groups(head)
    assert len(groups) == 1 and "weight_decay" not in groups[0]


def test_lm_loss_ignores_and_upcasts():
    logits = torch.randn(2, 5, 11).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    loss = lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    keep = labels != -100
    ref = nn.functional.cross_entropy(logits.float()[keep], labels[keep])
    assert torch.allclose(loss, ref)
