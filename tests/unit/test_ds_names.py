"""DeepSpeed parameter names -> dsnd's (`dsnd.checkpoint.ds_names`): the three namings a
DeepSpeed checkpoint can carry, and one line naming the first thing that does not fit."""

from __future__ import annotations

import re

import pytest

from dsnd.checkpoint.ds_names import dsnd_names, layer_indices, naming
from dsnd.errors import UserError
from dsnd.model.count import full_shapes
from dsnd.model.hf_weights import to_hf_names
from tests.models import spec_of

LLAMA, GPT2 = spec_of("llama-tiny"), spec_of("gpt2-tiny")  # untied, tied embeddings


def pipeline_shapes(model, position=lambda i: i) -> dict:
    """What a PipelineModule over `model`'s layers saves: `<position>.<name>` (dsnd layer i at
    `position(i)`), the tied module as `tied_modules.embed.<name>`."""
    out = {}
    for name, shape in full_shapes(model).items():
        kind, key, rest = name.split(".", 2)
        out[f"{position(int(key))}.{rest}" if kind == "layers" else name] = shape
    return out


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_pipeline_module_names_map_to_the_same_global_layers(model):
    shapes = pipeline_shapes(model)
    assert naming(list(shapes)) == "pipeline"
    mapping = dsnd_names(shapes, model, "D")
    assert sorted(mapping.values()) == sorted(full_shapes(model))
    assert all(ours.endswith(theirs.split(".", 1)[1]) for theirs, ours in mapping.items())
    assert mapping[
        "1.self_attn.q_proj.weight" if model is LLAMA else "1.attn.c_attn.weight"
    ].startswith("layers.1.")


def test_a_pipeline_with_parameter_free_layers_maps_in_order():
    # a lambda before every block: dsnd layer i sits at position 2i (0 stays 0)
    shapes = pipeline_shapes(LLAMA, lambda i: 2 * i)
    mapping = dsnd_names(shapes, LLAMA, "D")
    assert mapping["4.self_attn.q_proj.weight"] == "layers.2.self_attn.q_proj.weight"
    assert mapping["12.lm_head.weight"] == f"layers.{LLAMA.num_layers + 2}.lm_head.weight"


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_dsnd_and_transformers_names(model):
    ours = full_shapes(model)
    assert naming(list(ours)) == "dsnd"
    assert dsnd_names(ours, model, "D") == {n: n for n in ours}
    hf = {to_hf_names(n, model)[0]: shape for n, shape in ours.items()}
    assert naming(list(hf)) == "transformers"
    assert dsnd_names(hf, model, "D") == {to_hf_names(n, model)[0]: n for n in ours}


def _refusal(shapes: dict, model=LLAMA) -> str:
    with pytest.raises(UserError) as e:
        dsnd_names(shapes, model, "D")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_refusals_name_the_first_difference():
    shapes = pipeline_shapes(LLAMA)
    wider = dict(shapes, **{"2.mlp.up_proj.weight": (200, 64)})
    assert _refusal(wider) == (
        "D: DeepSpeed's layer_02: mlp.up_proj.weight has shape [200, 64], "
        "preset llama-tiny's layers.2.mlp.up_proj.weight has [176, 64]"
    )
    fewer = {k: v for k, v in shapes.items() if not k.startswith("3.")}
    assert _refusal(fewer) == (
        "D: the checkpoint's pipeline has 6 layers holding parameters, preset llama-tiny has 7 "
        "(num_layers=4)"
    )
    missing = {k: v for k, v in shapes.items() if k != "3.mlp.up_proj.weight"}
    assert _refusal(missing) == (
        "D: DeepSpeed's layer_03 has no mlp.up_proj.weight (shape [176, 64]), which preset "
        "llama-tiny's layers.3.* has"
    )
    assert _refusal(pipeline_shapes(GPT2)) == (
        "D: the checkpoint has 1 tied module(s) (tied_modules.embed) but preset llama-tiny has 0 "
        "(tie_word_embeddings=False)"
    )
    ours = full_shapes(LLAMA)
    extra = dict(ours, **{"layers.9.x.weight": (1,)})
    assert _refusal(extra) == (
        "D: parameter layers.9.x.weight is not one of preset llama-tiny's (llama (preset "
        "llama-tiny): hidden 64, 4 layers, 4 heads (2 kv), vocab 256)"
    )
    short = {k: v for k, v in ours.items() if not k.startswith("layers.4.")}
    assert re.fullmatch(
        r"D: the checkpoint has no layers\.4\.\S+ \(shape \[\d+(, \d+)*\]\), which preset "
        r"llama-tiny has \(and 8 more\)",
        _refusal(short),
    )
    assert _refusal({"encoder.block.0.weight": (4,)}) == (
        "D: parameter encoder.block.0.weight is not one of a llama model's (preset llama-tiny)"
    )


def test_layer_indices_put_a_tied_module_at_its_first_layer():
    layers = layer_indices(GPT2)
    assert layers["tied_modules.embed.wte.weight"] == 0
    assert layers["layers.1.attn.c_attn.weight"] == 1
    assert set(layers) == set(full_shapes(GPT2))
