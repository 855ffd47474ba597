"""Optimizer parameter groups: weight decay on matrices, none on norms, biases and embeddings."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dsnd.tp import VocabParallelEmbedding

# Whole modules whose parameters are never decayed. Decaying an embedding shrinks the rows of rare
# tokens towards zero between their updates; norms' gains and all biases are 1-D anyway.
NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    VocabParallelEmbedding,
    nn.LayerNorm,
    nn.RMSNorm,
    LlamaRMSNorm,
)


def _shape(param: nn.Parameter) -> tuple[int, ...]:
    return tuple(param.shape)


def param_groups(
    model: nn.Module, shape_of: Callable[[nn.Parameter], tuple[int, ...]] = _shape
) -> list[dict]:
    """`[{"params": decayed}, {"params": not_decayed, "weight_decay": 0.0}]` for trainable params,
    each group named (`name`: DeepSpeed splits named groups' expert parameters into groups of
    their own, `dsnd.engine.experts`).

    A parameter is not decayed when its owning module is in `NO_DECAY_MODULES` or it has fewer than
    two dimensions (biases, norm gains). A tied parameter appears once (in the group of its first
    owner). Empty groups are left out, e.g. for a pipeline stage holding only an untied head.
    `shape_of` gives a parameter's shape before ZeRO-3 partitioned it: a stage whose layers
    zero.Init already partitioned must pass the engine's `unpartitioned_shape`.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            ndim = len(shape_of(param))  # a ZeRO-3 parameter is a 1-D shard
            if isinstance(module, NO_DECAY_MODULES) or ndim < 2:
                no_decay.append(param)
            else:
                decay.append(param)
    groups: list[dict] = []
    if decay:
        groups.append({"params": decay, "name": "decay"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups
