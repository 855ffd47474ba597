"""Two random streams per rank, as Megatron's `CudaRNGStatesTracker`: replicated and split.

Dropout (and any other random op) must agree between ranks that hold the *same* activations and
differ between ranks that hold *different* slices of them:

- outside a tensor-parallel region (after a row-parallel layer's all-reduce, in the residual
  stream, in replicated layers) every tensor-parallel rank of a stage holds the full, identical
  activation, so its dropout mask must be identical on all of them — else the replicas diverge;
- inside a region (the output of a column-parallel layer, attention heads split across ranks)
  each rank holds a different slice, and equal masks would correlate the slices' dropout.

Seeds follow Megatron (`megatron/training/initialize.py::_set_random_seed` and
`megatron/core/tensor_parallel/random.py::model_parallel_cuda_manual_seed`)::

    default_seed = seed + 100 * pp_rank              # the process's default (global) generator
    tp_seed      = default_seed + 2718 + tp_rank      # the tensor-parallel stream, `fork()`

The default stream depends on the seed and the pipeline stage only, so every tensor- and
data-parallel rank of one stage draws the same sequence; stages differ because they run
different layers. The tensor-parallel stream is distinct per tp rank and equal across data-parallel
replicas of the same tp rank (the replicas hold the same slice). 2718 keeps the tp seeds clear of
the default seeds of nearby stages for tp < 100.

The default stream *is* torch's global generator (CPU, and the current CUDA device's when CUDA is
available), so plain `F.dropout` uses it. The tensor-parallel stream is a saved generator state
that `fork()` swaps in for the length of a block. The tracker is an object the caller keeps and
passes around, never a module global.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dsnd.topology import Coord

PIPELINE_SEED_STRIDE = 100
TP_SEED_OFFSET = 2718


def default_seed(seed: int, coord: Coord) -> int:
    """The seed of the replicated stream: same on every tp and dp rank of one pipeline stage."""
    return seed + PIPELINE_SEED_STRIDE * coord.pp


def tensor_parallel_seed(seed: int, coord: Coord) -> int:
    """The seed of the tensor-parallel stream: distinct per tp rank, shared by dp replicas."""
    return default_seed(seed, coord) + TP_SEED_OFFSET + coord.tp


def _cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _fresh_state(seed: int, device: int | None) -> dict[str, torch.Tensor | None]:
    """CPU (and CUDA) generator states seeded with `seed`, without touching the global ones."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if device is not None:
        cuda = torch.Generator(device=f"cuda:{device}").manual_seed(seed).get_state()
    return {"cpu": cpu, "cuda": cuda}


class TPRandomState:
    """The replicated (default) and tensor-parallel random streams of one rank.

    Creating it seeds the process's default generator with `default_seed(seed, coord)` (CPU and
    every CUDA device, as `torch.manual_seed` does) and the tensor-parallel stream with
    `tensor_parallel_seed(seed, coord)`. Draw replicated randomness as usual; draw split
    randomness inside ``with tracker.fork():``.
    """

    def __init__(self, seed: int, coord: Coord) -> None:
        self.seed = seed
        self.coord = coord
        self.default_seed = default_seed(seed, coord)
        self.tp_seed = tensor_parallel_seed(seed, coord)
        self._device = _cuda_device()
        self._forked = False
        torch.manual_seed(self.default_seed)
        self._tp_state = _fresh_state(self.tp_seed, self._device)

    def _get_global(self) -> dict[str, torch.Tensor | None]:
        cuda = None if self._device is None else torch.cuda.get_rng_state(self._device)
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def _set_global(self, state: dict[str, torch.Tensor | None]) -> None:
        torch.set_rng_state(state["cpu"])
        if self._device is not None:
            if state.get("cuda") is None:
                raise ValueError("RNG state holds no CUDA generator state but CUDA is in use")
            torch.cuda.set_rng_state(state["cuda"], self._device)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on the tensor-parallel stream, then return to the default stream.

        The default stream continues exactly where it was left, as if the block had drawn
        nothing; the tensor-parallel stream continues where the block left it at the next fork.
        """
        if self._forked:
            raise RuntimeError("TPRandomState.fork() is already active; forks do not nest")
        saved = self._get_global()
        self._set_global(self._tp_state)
        self._forked = True
        try:
            yield
        finally:
            self._tp_state = self._get_global()
            self._set_global(saved)
            self._forked = False

    def state_dict(self) -> dict[str, Any]:
        """Both streams' current states (copies), for a checkpoint of this rank."""
        if self._forked:
            raise RuntimeError("state_dict() inside fork(): the streams are swapped")

        def copy(state: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
            return {k: None if v is None else v.clone() for k, v in state.items()}

        return {
            "default_seed": self.default_seed,
            "tp_seed": self.tp_seed,
            "default": copy(self._get_global()),
            "tensor_parallel": copy(self._tp_state),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore both streams from `state_dict()`: the next draws repeat the saved ones."""
        if self._forked:
            raise RuntimeError("load_state_dict() inside fork(): the streams are swapped")
        missing = {"default", "tensor_parallel"} - set(state)
        if missing:
            raise KeyError(f"RNG state lacks {sorted(missing)}")
        tp = state["tensor_parallel"]
        if self._device is not None and tp.get("cuda") is None:
            raise ValueError("RNG state holds no CUDA generator state but CUDA is in use")
        self._set_global(state["default"])
        self._tp_state = {
            "cpu": tp["cpu"].clone(),
            "cuda": None if self._device is None else tp["cuda"].clone(),
        }
