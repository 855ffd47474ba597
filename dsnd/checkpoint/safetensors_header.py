"""The header of a safetensors file, read and checked in pure Python (no torch, no Rust).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {str: str}}``, then
the data area, where offsets count from. dsnd reads the header itself before any tensor so that
a hostile or damaged file is refused with one line naming what is wrong, instead of a library
traceback or a silent reinterpretation of the bytes; it accepts only what the safetensors library
accepts too (tensors tile the data area exactly, as the library requires).
"""

from __future__ import annotations

import json
import math
import os
import struct

MAX_HEADER_BYTES = 100 * 2**20  # far above any real header; a larger N is damage, not data
METADATA = "__metadata__"
# bytes per element of every dtype the format defines with whole bytes per element
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})


class HeaderError(ValueError):
    """A safetensors header that is not one (the message is one line, without the path)."""


def read_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} of the safetensors file `path`; HeaderError if the header
    is malformed or its offsets do not tile the data area."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{size} bytes: too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise HeaderError(
                f"header length {length} does not fit the file's {size} bytes "
                f"(limit {MAX_HEADER_BYTES})"
            )
        raw = f.read(length)
    return parse_header(raw, size - 8 - length)


def parse_header(raw: bytes, data_bytes: int) -> dict[str, tuple[str, list[int]]]:
    """`read_header` on the header's bytes, given the size of the data area after them."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is a ValueError too
        raise HeaderError(f"header is not valid JSON ({e})") from e
    if not raw.startswith(b"{") or not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    meta = header.pop(METADATA, {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError(f"{METADATA} is not an object of strings")
    tensors, spans = {}, []
    for name, entry in header.items():
        dtype, shape, span = _entry(name, entry)
        if span[1] > data_bytes:
            raise HeaderError(
                f"{name}: data_offsets {list(span)} end past the data area ({data_bytes} bytes)"
            )
        tensors[name] = (dtype, shape)
        spans.append((span, name))
    end = 0
    for (begin, stop), name in sorted(spans):
        if begin != end:
            raise HeaderError(
                f"{name}: data_offsets {[begin, stop]} leave a gap or overlap at "
                f"byte {end} of the data area"
            )
        end = stop
    if end != data_bytes:
        raise HeaderError(f"tensors cover {end} bytes, the data area holds {data_bytes}")
    return tensors


def _entry(name: str, entry: object) -> tuple[str, list[int], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one header entry, checked for types and size."""
    if not isinstance(entry, dict):
        raise HeaderError(f"{name}: entry is not an object")
    dtype, shape, span = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise HeaderError(f"{name}: unknown dtype {str(dtype)[:20]!r}")
    if not _ints(shape):
        raise HeaderError(f"{name}: shape {str(shape)[:40]} is not a list of sizes")
    if not _ints(span) or len(span) != 2 or span[0] > span[1]:
        raise HeaderError(f"{name}: data_offsets {str(span)[:40]} are not [begin, end]")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if span[1] - span[0] != want:
        raise HeaderError(
            f"{name}: data_offsets {span} hold {span[1] - span[0]} bytes, "
            f"{dtype} {shape} needs {want}"
        )
    return dtype, shape, (span[0], span[1])


def _ints(value: object) -> bool:
    """A list of non-negative integers (JSON booleans are not sizes)."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
