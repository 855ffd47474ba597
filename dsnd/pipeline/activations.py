"""Activation memory of one rank over one step: the bytes autograd saves for backward in this
stage's forwards, live and peak, counted with `torch.autograd.graph.saved_tensors_hooks`. CPU
torch keeps no allocator statistics, so this is how activations become visible there; on CUDA it
tells them apart from the allocator's totals.

- Each forward instruction (micro-batch, chunk) runs under the hooks; every storage a saved tensor
  lives in counts once, at its full size (a saved view keeps its whole storage alive), even when
  several saved tensors or several in-flight micro-batches share it.
- A micro-batch's bytes are released when its backward ends (B, or W for a split backward: the
  input pass frees part of them early, so between I and W the live figure is an upper bound).
- Weights are not activations: parameters and views of them (ZeRO-3's gathered parameters are the
  same `nn.Parameter` objects), module buffers and tied weights borrowed from another stage are
  left out. The received activation a stage's first layer saves is counted.
- The pack hook only looks: autograd saves exactly what it would without it.
- Sampled: the first step, then every `EVERY`-th. A step runs the same program on micro-batches
  of the same shapes as every other, so it holds the same bytes. Measuring costs two Python
  calls per saved tensor (torch's pack and unpack; llama-tiny saves 165 per forward), about half
  of it torch's hook mechanism itself. Observed (not in the suite) on one rank training
  llama-tiny (ZeRO-1, 16 samples per step in micro-batches of 2, one thread), median step time
  with every step metered / none: 1.058 at 64 tokens per sample, 1.013 at 128 (this shared CPU's
  noise is a few %); sampled, well under 0.1%.

Under activation checkpointing the count is what checkpointing keeps (each chunk's input).
Tensors that live only inside one forward or backward (temporaries, recomputation), gradients and
communication buffers are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch
from torch import nn


def _is_parameter(t: torch.Tensor) -> bool:
    """`t` is a parameter or a view of one. A parameter is a leaf that requires grad: most
    activations fail those two cheap tests before the slower isinstance of `nn.Parameter`."""
    base = t if t._base is None else t._base
    return base.requires_grad and base.is_leaf and isinstance(base, nn.Parameter)


EVERY = 100  # steps between measured ones


class ActivationMeter:
    """Live and peak activation bytes of the micro-batches in flight on this rank.

    `weights()` lists the tensors that are not activations besides parameters (buffers, borrowed
    tied weights); it is read at the first forward of each measured step (after the step's tied
    borrow). `peak` is the latest measured step's; steps 0, `every`, 2 * `every`, ... of this
    meter are measured.
    """

    def __init__(self, weights: Callable[[], Iterable[torch.Tensor]], every: int = EVERY) -> None:
        self._weights, self.every = weights, every
        self._steps = 0
        self.measuring = True
        self.peak = 0
        self._reset()

    def begin(self) -> None:
        """Start a step: nothing in flight; when this step is measured, peak 0."""
        self.measuring = self._steps % self.every == 0
        self._steps += 1
        if self.measuring:
            self.peak = 0
            self._reset()

    def _reset(self) -> None:
        self.live = 0
        self._skip: set[int] | None = None  # storages of `weights()`, read at the first forward
        self._held: dict[int, list[int]] = {}  # storage -> [bytes, micro-batches holding it]
        self._owned: dict[Hashable, list[int]] = {}  # micro-batch key -> its storages
        self._current: dict[int, int] = {}  # the running forward's storages -> bytes

    @contextlib.contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        """Count what autograd saves inside the block as micro-batch `key`'s (added to what the
        key already holds: a chunk's loss after its layers), when this step is measured."""
        if not self.measuring:
            yield
            return
        if self._skip is None:
            self._skip = {t.untyped_storage().data_ptr() for t in self._weights() if t.numel()}
        self._current = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            owned = self._owned.setdefault(key, [])
            for ptr, nbytes in self._current.items():
                held = self._held.get(ptr)
                if held is None:
                    self._held[ptr] = [nbytes, 1]
                    self.live += nbytes
                else:
                    held[1] += 1
                owned.append(ptr)
            self._current = {}
            self.peak = max(self.peak, self.live)

    def release(self, key: Hashable) -> None:
        """Micro-batch `key`'s backward is done: autograd has freed what it saved."""
        for ptr in self._owned.pop(key, ()):
            held = self._held[ptr]
            held[1] -= 1
            if held[1] == 0:
                del self._held[ptr]
                self.live -= held[0]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
            return t
        ptr = storage.data_ptr()
        if ptr not in self._current and ptr not in self._skip and not _is_parameter(t):
            self._current[ptr] = storage.nbytes()
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
