"""Activation checkpointing per layer interval, as DeepSpeed's
`PipelineModule(activation_checkpoint_interval=k)`.

A stage's layers run in consecutive chunks of k (the last may be shorter), counted from the
stage's first layer as `PipelineModule.forward` counts them. While training, each chunk runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`: the forward keeps only the chunk's input
for backward and drops everything computed inside it; backward reruns the chunk to get those
tensors back. Memory held between a micro-batch's forward and its backward falls from every
layer's intermediates (attention, MLP, norms) to one (micro, seq, hidden) tensor per chunk, for
about one extra forward of compute.

Non-reentrant checkpointing, not the reentrant kind DeepSpeed defaults to: it gives parameter
gradients even when the chunk's input needs none (the first stage's input is int64 token ids,
and its first chunk holds the embedding). Recomputation calls each layer through
`nn.Module.__call__`, so ZeRO-3's pre-forward hooks gather the partitioned parameters again; no
ZeRO-3 special case is needed (pipeline parity tests at ZeRO-3 with pp=2 and pp=1). Dropout
masks replay exactly: the chunk's RNG state is saved and restored for the rerun.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

Layer = Callable[[torch.Tensor], torch.Tensor]


def in_recompute() -> bool:
    """Whether a forward runs inside backward: a checkpointed chunk's rerun (autograd's graph
    task is active), which hooks that count a forward's work must not count again."""
    return torch._C._current_graph_task_id() != -1


def chunk_bounds(num_layers: int, interval: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `interval` consecutive layers; one chunk when 0 (off)."""
    if interval < 0:
        raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
    if interval == 0:
        return [(0, num_layers)]
    return [(s, min(s + interval, num_layers)) for s in range(0, num_layers, interval)]


def _run(layers: Sequence[Layer], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def run_layers(
    layers: Sequence[Layer], x: torch.Tensor, interval: int, recompute: bool
) -> torch.Tensor:
    """`layers` applied in order to `x`; with `recompute` and `interval` k > 0, each chunk of k
    layers is checkpointed. Callers pass `recompute = module.training and
    torch.is_grad_enabled()`: in evaluation nothing is kept for backward anyway."""
    if not recompute or interval == 0:
        return _run(layers, x)
    for start, end in chunk_bounds(len(layers), interval):
        x = checkpoint(partial(_run, layers[start:end]), x, use_reentrant=False)
    return x
