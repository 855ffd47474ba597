"""A model's parameters, counted on the meta device: names, full shapes and per-layer counts of
any size (a 70B model costs no memory and a few seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from dsnd.model.layer_spec import TiedLayerSpec
from dsnd.model.moe_config import EXPERT_WEIGHTS, active_share
from dsnd.model.source import ModelSpec
from dsnd.model.stack import layer_specs


def meta_layers(model: ModelSpec) -> Iterator[tuple[int, str, nn.Module | None]]:
    """(global index, dsnd name prefix, the layer built on meta) for every layer; a tied
    module is built at its first index and is None (nothing new) at the others."""
    seen: set[str] = set()
    for index, spec in enumerate(layer_specs(model)):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                yield index, f"tied_modules.{spec.key}.", None
                continue
            seen.add(spec.key)
            prefix = f"tied_modules.{spec.key}."
        else:
            prefix = f"layers.{index}."
        with torch.device("meta"):
            yield index, prefix, spec.build()


def full_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's dsnd name and full (unsplit) shape."""
    return {
        prefix + name: tuple(p.shape)
        for _, prefix, layer in meta_layers(model)
        if layer is not None
        for name, p in layer.named_parameters()
    }


def layer_table(model: ModelSpec) -> list[tuple[int, str, int]]:
    """(global index, layer kind, parameters) per layer; a tied head counts 0 (its weight is
    the embedding's). The counts sum to the model's total."""
    rows = []
    for index, _, layer in meta_layers(model):
        if layer is None:
            rows.append((index, "head (tied to the embedding)", 0))
        else:
            rows.append((index, type(layer).__name__, sum(p.numel() for p in layer.parameters())))
    return rows


def expert_table(model: ModelSpec) -> dict[int, int]:
    """Global layer index -> the parameters of its routed experts (the fused (E, ., .) weights
    that expert parallelism splits; `dsnd.model.moe_config.EXPERT_WEIGHTS`); empty for a dense
    model."""
    if not model.family.moe:
        return {}
    return {
        index: sum(p.numel() for name, p in layer.named_parameters() if EXPERT_WEIGHTS.search(name))
        for index, _, layer in meta_layers(model)
        if layer is not None
    }


def matmul_params(model: ModelSpec) -> int:
    """Parameters one token multiplies: every block's projections (nn.Linear and Conv1D
    weights) and the output head; not the input embedding (a lookup), norms, biases or position
    embeddings. A head tied to the embedding counts once. In a mixture-of-experts block the
    router counts whole and the routed experts' 3-D weights by the token's share, top-k /
    experts (its blocks can differ, dense or sparse by layer, so each is counted)."""
    layers = range(model.num_layers) if model.family.moe else range(1)
    share = active_share(model.config) if model.family.moe else 1.0
    total = 0.0
    for index in layers:
        with torch.device("meta"):
            block = model.family.block(model.config, index)
        for mod in block.modules():
            for attr, p in mod.named_parameters(recurse=False):
                if attr == "weight" and isinstance(mod, (nn.Linear, Conv1D)):
                    total += p.numel()
                elif p.ndim == 3:  # routed experts (E, out, in)
                    total += p.numel() * share
                elif p.ndim == 2 and hasattr(mod, "top_k"):  # the router's (E, hidden)
                    total += p.numel()
    per_layer = 1 if model.family.moe else model.num_layers
    return round(per_layer * total) + model.vocab_size * model.hidden_size
