"""Parameter names: dsnd `LayerStack` ↔ the family's `*ForCausalLM` (its `HFNames`).

dsnd names carry the global layer index (see `dsnd.model.stack`), N = num_layers:
  layers.0.<e>              ↔ <base><e>, e.g. model.embed_tokens.weight     (embedding)
  tied_modules.embed.<e>    ↔ the same, and also lm_head.weight for the tied weight
  layers.<1..N>.<rest>      ↔ <blocks><i-1>.<rest>, e.g. model.layers.<i-1>.<rest>
  layers.<N+1>.<norm>       ↔ <base><norm>, e.g. model.norm.weight
  layers.<N+2>.lm_head.weight ↔ lm_head.weight                            (untied head)
Inside a layer the names are those of the HF modules, so only prefixes change.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dsnd.model.source import ModelSpec
from dsnd.model.stack import TIED_EMBED_KEY

_HEAD = "lm_head.weight"


def _embed_prefix(model: ModelSpec) -> str:
    return f"tied_modules.{TIED_EMBED_KEY}." if model.tie_embeddings else "layers.0."


def to_hf_names(name: str, model: ModelSpec) -> list[str]:
    """The HF names of dsnd parameter `name` (two for a tied weight: embedding, then head)."""
    lay, n = model.family.names, model.num_layers
    if name.startswith(f"tied_modules.{TIED_EMBED_KEY}."):
        rest = name.removeprefix(f"tied_modules.{TIED_EMBED_KEY}.")
        return [lay.base + rest] + ([_HEAD] if rest == lay.tied_attr else [])
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"not a dsnd layer parameter: {name!r}")
    index, rest = int(match.group(1)), match.group(2)
    if index == 0:
        return [lay.base + rest]
    if 1 <= index <= n:
        return [f"{lay.blocks}{index - 1}.{rest}"]
    if index == n + 1:
        return [lay.base + rest]
    if index == n + 2:
        return [rest]
    raise KeyError(f"layer index {index} out of range for {n} blocks: {name!r}")


def from_hf_name(name: str, model: ModelSpec) -> str | None:
    """The dsnd name of HF parameter `name`, or None for entries dsnd does not store."""
    lay, n = model.family.names, model.num_layers
    if re.search(lay.ignored, name):
        return None
    if name == _HEAD:
        return None if model.tie_embeddings else f"layers.{n + 2}.{_HEAD}"
    if name.startswith(lay.blocks):
        match = re.fullmatch(r"(\d+)\.(.+)", name.removeprefix(lay.blocks))
        if match is not None and int(match.group(1)) < n:
            return f"layers.{int(match.group(1)) + 1}.{match.group(2)}"
    elif name.startswith(lay.base):
        rest = name.removeprefix(lay.base)
        head = rest.split(".")[0]
        if head in lay.embedding:
            return _embed_prefix(model) + rest
        if head == lay.final_norm:
            return f"layers.{n + 1}.{rest}"
    raise KeyError(f"unexpected {model.family.name} HF parameter: {name!r}")


def to_hf_state_dict(stack: nn.Module, model: ModelSpec) -> dict[str, torch.Tensor]:
    """The HF state dict of `model`'s tensors (a full model loads with `strict=True`).

    A partial `LayerStack` (one pipeline stage) maps just the layers it holds. A tied weight is
    returned under both HF names, as `LlamaForCausalLM.state_dict()` lists it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in stack.state_dict().items():
        for hf_name in to_hf_names(name, model):
            out[hf_name] = tensor
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """dsnd-named tensors from an HF state dict; raises KeyError on names it does not know."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in sd.items():
        name = from_hf_name(hf_name, model)
        if name is not None:
            out[name] = tensor
    return out
