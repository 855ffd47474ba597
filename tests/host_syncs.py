"""Device-to-host syncs counted on the CPU: what a block of code would make a GPU wait for.

On a GPU the host queues kernels and runs ahead; an operation whose result the host must read
(a Python number from a tensor, an output whose size depends on the data) stops it until the
device has caught up. A CPU has nothing to wait for, so these are found by what is called:

- operators whose output size depends on the values (`bincount`, `nonzero`, boolean indexing,
  `masked_select`, `unique`, `repeat_interleave` without `output_size`) or that return a host
  number (`_local_scalar_dense`: `.item()`, `bool(t)`, `if t.any():`), seen by a dispatch mode;
- `Tensor.tolist`, `.cpu`, `.numpy`, which do not pass through the dispatcher on a CPU tensor,
  wrapped while the block runs.

Each one is recorded with the nearest caller in dsnd (or in the tests; else the library).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DATA_SIZED = {
    aten.bincount,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten._local_scalar_dense,
    aten.is_nonzero,
}
_HOST_METHODS = ("tolist", "cpu", "numpy")


def _caller() -> str:
    """file:line of the nearest frame in dsnd (else the tests, else anywhere but here)."""
    frame, fallback = sys._getframe(2), ""
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "torch/utils" not in name:
            here = f"{os.path.basename(name)}:{frame.f_lineno}"
            if "/dsnd/" in name:
                return here
            fallback = fallback or here
        frame = frame.f_back
    return fallback


def _bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


class _Syncs(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        sync = packet in _DATA_SIZED
        sync |= (
            packet is aten.repeat_interleave
            and kwargs.get("output_size") is None
            and isinstance(args[0], torch.Tensor)
            and func is aten.repeat_interleave.Tensor
        )
        sync |= packet in (aten.index, aten.index_put, aten.index_put_) and _bool_index(args[1])
        if sync:
            self.found.append(f"{packet.__name__} at {_caller()}")
        return func(*args, **kwargs)


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """A list filled with one line per host sync made inside the block ("op at file:line")."""
    found: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_METHODS}

    def wrap(name: str):
        def method(self, *args, **kwargs):
            found.append(f"{name} at {_caller()}")
            return saved[name](self, *args, **kwargs)

        return method

    for name in _HOST_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with _Syncs(found):
            yield found
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
