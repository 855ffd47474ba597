"""A safetensors file written one tensor at a time, byte for byte what `save_file` writes.

`save_file` needs every tensor in memory at once (it serialises a dict). An export of a model
that no single rank may hold whole (`dsnd.model.hf_export`) knows every tensor's name, dtype and
shape before any value arrives, so it can lay the file out first and fill it as values come:

    [8-byte little-endian N][N bytes of JSON header, space-padded to N % 8 == 0][data area]

The header lists ``__metadata__`` first, then every tensor with ``data_offsets`` [begin, end)
into the data area, in the order the data lies. That order is the library's own (descending
dtype, then name: all 8-byte dtypes first, so every tensor stays aligned to its element size);
rather than restating it, `layout` asks the library for it by serialising one element of each
tensor, so a library that changed its order would still be matched. The bytes of the file are
then the same as `save_file`'s for the same tensors (tests/unit/test_hf_export.py compares
them), and the memory held is one tensor, whatever the file's size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from types import TracebackType

import torch
from safetensors.torch import save

_ALIGN = 8  # the header is padded with spaces to a multiple of 8 bytes

Spec = tuple[torch.dtype, tuple[int, ...]]


def layout(
    specs: Mapping[str, Spec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's first 8 + N bytes, and each tensor's [begin, end) in the data area.

    The order and the dtype names come from the library serialising one element per tensor
    (a few bytes each); the offsets are then the running sum of numel x element size."""
    probe = save(
        {name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in specs.items()},
        metadata=dict(metadata) if metadata is not None else None,
    )
    (length,) = struct.unpack("<Q", probe[:8])
    probed = json.loads(probe[8 : 8 + length].decode("utf-8"))  # keeps the library's order
    header: dict[str, object] = {}
    if "__metadata__" in probed:
        header["__metadata__"] = probed.pop("__metadata__")
    offsets: dict[str, tuple[int, int]] = {}
    begin = 0
    for name, entry in probed.items():
        dtype, shape = specs[name]
        end = begin + math.prod(shape) * dtype.itemsize
        offsets[name] = (begin, end)
        header[name] = {"dtype": entry["dtype"], "shape": list(shape), "data_offsets": [begin, end]}
        begin = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw, offsets


class StreamedSafetensors:
    """`path` laid out for `specs` (name -> (dtype, shape)); `write` each tensor once, in any
    order; leaving the `with` block checks that every one was written (else ValueError)."""

    def __init__(
        self, path: str, specs: Mapping[str, Spec], metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path, self._specs = path, dict(specs)
        prefix, self._offsets = layout(self._specs, metadata)
        self._data = len(prefix)
        self._missing = set(self._specs)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by __exit__)
        self._file.write(prefix)
        self._file.truncate(self._data + max((e for _, e in self._offsets.values()), default=0))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put `name`'s value (its declared dtype and shape, any device) at its place."""
        if name not in self._missing:
            raise ValueError(f"{name}: not a tensor of this file, or written twice")
        dtype, shape = self._specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: {tensor.dtype} {list(tensor.shape)}, declared {dtype} {list(shape)}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._data + self._offsets[name][0])
        self._file.write(memoryview(flat.numpy()))
        self._missing.discard(name)

    def __enter__(self) -> StreamedSafetensors:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._file.close()
        if kind is None and self._missing:
            raise ValueError(
                f"{self.path}: {len(self._missing)} tensors never written, e.g. "
                f"{sorted(self._missing)[0]}"
            )
