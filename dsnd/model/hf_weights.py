"""Parameter names: dsnd `LayerStack` ↔ `LlamaForCausalLM` / `GPT2LMHeadModel`.

dsnd names carry the global layer index (see `dsnd.model.specs`), N = num_layers:
  layers.0.<e>              ↔ model.<e> / transformer.<e>                  (embedding)
  tied_modules.embed.<e>    ↔ the same, and also lm_head.weight for the tied weight
  layers.<1..N>.<rest>      ↔ model.layers.<i-1>.<rest> / transformer.h.<i-1>.<rest>
  layers.<N+1>.<norm>       ↔ model.norm.weight / transformer.ln_f.{weight,bias}
  layers.<N+2>.lm_head.weight ↔ lm_head.weight                            (untied head)
Inside a layer the names are those of the HF modules, so only prefixes change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from dsnd.config.presets import ModelDims
from dsnd.model.layers import GPT2Embedding, LlamaEmbedding
from dsnd.model.specs import TIED_EMBED_KEY

_HEAD = "lm_head.weight"
# Buffers some HF checkpoints carry that dsnd recomputes (rotary frequencies, GPT-2's old mask).
_IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


@dataclass(frozen=True)
class _Layout:
    base: str  # "model." / "transformer."
    blocks: str  # "model.layers." / "transformer.h."
    embed_names: tuple[str, ...]  # first name part of the embedding's parameters
    final_norm: str  # first name part of the final norm's parameters
    tied_attr: str


def hf_layout(dims: ModelDims) -> _Layout:
    if dims.family == "llama":
        return _Layout(
            "model.", "model.layers.", ("embed_tokens",), "norm", LlamaEmbedding.tied_weight_attr
        )
    if dims.family == "gpt2":
        return _Layout(
            "transformer.", "transformer.h.", ("wte", "wpe"), "ln_f", GPT2Embedding.tied_weight_attr
        )
    raise ValueError(f"unknown model family {dims.family!r}")


def _embed_prefix(dims: ModelDims) -> str:
    return f"tied_modules.{TIED_EMBED_KEY}." if dims.tie_embeddings else "layers.0."


def to_hf_names(name: str, dims: ModelDims, lay: _Layout) -> list[str]:
    n = dims.num_layers
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


def _from_hf_name(name: str, dims: ModelDims, lay: _Layout) -> str | None:
    """The dsnd name of HF parameter `name`, or None for entries dsnd does not store."""
    if _IGNORED_HF.search(name):
        return None
    if name == _HEAD:
        return None if dims.tie_embeddings else f"layers.{dims.num_layers + 2}.{_HEAD}"
    if name.startswith(lay.blocks):
        match = re.fullmatch(r"(\d+)\.(.+)", name.removeprefix(lay.blocks))
        if match is not None and int(match.group(1)) < dims.num_layers:
            return f"layers.{int(match.group(1)) + 1}.{match.group(2)}"
    elif name.startswith(lay.base):
        rest = name.removeprefix(lay.base)
        head = rest.split(".")[0]
        if head in lay.embed_names:
            return _embed_prefix(dims) + rest
        if head == lay.final_norm:
            return f"layers.{dims.num_layers + 1}.{rest}"
    raise KeyError(f"unexpected {dims.family} HF parameter: {name!r}")


def to_hf_state_dict(model: nn.Module, dims: ModelDims) -> dict[str, torch.Tensor]:
    """The HF state dict of `model`'s tensors (a full model loads with `strict=True`).

    A partial `LayerStack` (one pipeline stage) maps just the layers it holds. A tied weight is
    returned under both HF names, as `LlamaForCausalLM.state_dict()` lists it.
    """
    lay = hf_layout(dims)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        for hf_name in to_hf_names(name, dims, lay):
            out[hf_name] = tensor
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """dsnd-named tensors from an HF state dict; raises KeyError on names it does not know."""
    lay = hf_layout(dims)
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in sd.items():
        name = _from_hf_name(hf_name, dims, lay)
        if name is not None:
            out[name] = tensor
    return out
