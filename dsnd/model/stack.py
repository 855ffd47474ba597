"""The model as a flat list of DeepSpeed layer specs, and the module that builds any subset of it.

Global layer index i: 0 = embedding, 1..num_layers = blocks, num_layers+1 = final norm,
num_layers+2 = head. With tied embeddings the embedding and the head are `TiedLayerSpec`s with one
key, as in DeepSpeed's GPT-NeoX/Megatron examples: one module is built, the head calls its
`logits` through `forward_fn`. The layers are the model family's (`dsnd.model.families`).

Each layer is built on the meta device, given memory for this rank's shards only
(`dsnd.model.parallelize.materialize`), initialised, and then handed to `partition` (ZeRO-3's
conversion), so no rank ever holds a full layer it does not keep. Initial weights depend only
on (seed, global layer index, parameter name), never on the rank, stage or the order layers
are built in, so every layout starts from the same model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from dsnd.cp.context import ContextParallel
from dsnd.model.checkpointing import run_layers
from dsnd.model.decoder import LMHead, tied_logits
from dsnd.model.documents import Documents
from dsnd.model.layer_spec import LayerSpec, TiedLayerSpec
from dsnd.model.parallelize import materialize
from dsnd.model.source import ModelSpec
from dsnd.tp import load_full
from dsnd.tp.context import TensorParallel

TIED_EMBED_KEY = "embed"

_MATRICES = (nn.Linear, Conv1D, nn.Embedding)


def layer_specs(
    model: ModelSpec,
    tp: TensorParallel | None = None,
    cp: ContextParallel | None = None,
    documents: Documents | None = None,
) -> list[LayerSpec]:
    """Embedding, `num_layers` blocks, final norm, head: `num_layers + 3` specs.

    With a tensor-parallel group of more than one rank each rank builds its shards (same
    names and full shapes, see `dsnd.model.parallelize`); with a context-parallel group of more
    than one rank the embedding and blocks work on this rank's slice of each sequence; with
    `documents` they keep the packed documents of each sample apart (`dsnd.model.documents`).
    """
    fam, config = model.family, model.config
    blocks = [LayerSpec(fam.block, config, i, tp, cp, documents) for i in range(model.num_layers)]
    if not model.tie_embeddings:
        return [
            LayerSpec(fam.embedding, config, tp, cp, documents),
            *blocks,
            LayerSpec(fam.final_norm, config, tp),
            LayerSpec(LMHead, config, tp),
        ]
    attr = fam.embedding.tied_weight_attr
    head = {"forward_fn": tied_logits, "tied_weight_attr": attr}
    return [
        TiedLayerSpec(
            TIED_EMBED_KEY, fam.embedding, config, tp, cp, documents, tied_weight_attr=attr
        ),
        *blocks,
        LayerSpec(fam.final_norm, config, tp),
        TiedLayerSpec(TIED_EMBED_KEY, fam.embedding, config, tp, cp, documents, **head),
    ]


def _generator(seed: int, layer_index: int, name: str) -> torch.Generator:
    # hashlib, not hash(): Python salts str hashes per process.
    digest = hashlib.sha256(f"{seed}/{layer_index}/{name}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return gen


def _initial_value(
    owner: nn.Module, attr: str, param: torch.Tensor, std: float, gen: torch.Generator
) -> torch.Tensor:
    """The FULL tensor's initial value (a tensor-parallel shard is cut from it by the caller)."""
    shard = getattr(param, "tp_shard", None)
    shape = shard.full_shape(param.shape) if shard is not None else tuple(param.shape)
    if attr == "bias":
        return torch.zeros(shape)
    if isinstance(owner, _MATRICES) or param.ndim >= 2:
        return torch.empty(shape).normal_(0.0, std, generator=gen)
    if attr == "weight" and param.ndim == 1:  # a norm's gain (RMSNorm, LayerNorm, q/k norms)
        return torch.ones(shape)
    raise ValueError(f"init_layer: no rule for {type(owner).__name__}.{attr} {shape}")


@torch.no_grad()
def init_layer(module: nn.Module, seed: int, layer_index: int, std: float) -> None:
    """Initialise every parameter of `module` from (seed, layer_index, its name in `module`).

    Linear/Conv1D/embedding weights ~ N(0, std), norm gains 1, biases 0. Values are drawn in
    fp32 on the CPU and copied, so they do not depend on the parameter's device or dtype. A
    tensor-parallel shard draws the full tensor and keeps its part, so the full model is the same
    whatever the tensor-parallel size.
    """
    for mod_name, mod in module.named_modules():
        for attr, param in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            value = _initial_value(mod, attr, param, std, _generator(seed, layer_index, name))
            load_full(param, value)


class LayerStack(nn.Module):
    """The layers `layer_indices` (global, ascending; default all) of `specs`, run in order.

    Parameter names carry the GLOBAL layer index, as in DeepSpeed's `PipelineModule`, so a name
    means the same tensor on every pipeline layout: `layers.<i>.<name in layer>` for plain specs,
    `tied_modules.<key>.<name>` for a tied module, which is built once per stack (at the first of
    its indices here) and initialised with the index of the key's first spec in `specs`.
    `init_std` defaults to each layer's own `init_std` attribute.
    `activation_checkpoint_interval` k > 0 recomputes each run of k consecutive layers of this
    stack in backward while training (`dsnd.model.checkpointing`); 0 keeps every activation.
    `partition` is called on each layer once it is initialised (ZeRO-3 shards it there).
    `chunk_sizes` splits the stack into consecutive model chunks (interleaved pipelines hold
    several per rank); `forward(x, chunk)` runs one of them. Default: one chunk of everything.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        seed: int,
        layer_indices: Sequence[int] | None = None,
        init_std: float | None = None,
        activation_checkpoint_interval: int = 0,
        partition: Callable[[nn.Module], None] | None = None,
        chunk_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        self.activation_checkpoint_interval = activation_checkpoint_interval
        indices = list(range(len(specs))) if layer_indices is None else list(layer_indices)
        if any(i < 0 or i >= len(specs) for i in indices) or indices != sorted(set(indices)):
            raise ValueError(f"layer_indices must be ascending, unique, < {len(specs)}: {indices}")
        self.global_indices: tuple[int, ...] = tuple(indices)
        sizes = [len(indices)] if chunk_sizes is None else list(chunk_sizes)
        if sum(sizes) != len(indices) or min(sizes) < 1:
            raise ValueError(f"chunk_sizes {sizes} must be >= 1 each and sum to {len(indices)}")
        ends = [sum(sizes[: c + 1]) for c in range(len(sizes))]
        self._chunk_bounds = list(zip([0] + ends[:-1], ends, strict=True))
        # tied_modules first so a tied embedding leads the parameter order, as it runs first.
        self.tied_modules = nn.ModuleDict()
        self.layers = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._forward_funcs: list[Callable[[torch.Tensor], torch.Tensor]] = []
        first_tied_index: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                first_tied_index.setdefault(spec.key, i)
        self.tied_first_index = first_tied_index  # a tied module belongs to its first layer

        for index in indices:
            spec = specs[index]
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    module = _build(spec, seed, first_tied_index[spec.key], init_std, partition)
                    self.tied_modules[spec.key] = module
                    self.tied_weight_attrs[spec.key] = list(spec.tied_weight_attr)
                module = self.tied_modules[spec.key]
                fn = module if spec.forward_fn is None else partial(spec.forward_fn, module)
                self._forward_funcs.append(fn)
            else:
                module = _build(spec, seed, index, init_std, partition)
                self.layers[str(index)] = module
                self._forward_funcs.append(module)

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        recompute = self.training and torch.is_grad_enabled()
        lo, hi = self._chunk_bounds[chunk]
        funcs = self._forward_funcs[lo:hi]
        return run_layers(funcs, x, self.activation_checkpoint_interval, recompute)


def layer_of(name: str, stack: LayerStack) -> int:
    """The global layer index a parameter name of `stack` belongs to."""
    kind, key = name.split(".")[:2]
    if kind == "layers":
        return int(key)
    if kind == "tied_modules":
        return stack.tied_first_index[key]
    raise KeyError(f"not a LayerStack parameter name: {name!r}")


def _build(
    spec: LayerSpec,
    seed: int,
    index: int,
    init_std: float | None,
    partition: Callable[[nn.Module], None] | None,
) -> nn.Module:
    """Layer `index` of the model: built on meta, this rank's shards allocated, initialised
    from (seed, index, name), then partitioned."""
    with torch.device("meta"):
        module = spec.build()
    materialize(module)
    std = init_std if init_std is not None else getattr(module, "init_std", None)
    if std is None:
        raise ValueError(f"{type(module).__name__} has no init_std; pass LayerStack(init_std=...)")
    init_layer(module, seed, index, std)
    if partition is not None:
        partition(module)
    return module


def build_model(model: ModelSpec, seed: int, documents: Documents | None = None) -> LayerStack:
    """All layers of `model` on one rank, initialised from `seed` (reading packed documents'
    layout from `documents`, when given)."""
    return LayerStack(layer_specs(model, documents=documents), seed)
