"""The optional files beside a token file (`dsnd.data.token_writer` writes them), memory-mapped
and checked in constant time — sizes against the sidecar's counts and the ends of the document
starts — so a run's start costs the same for a file of any size:

    OUT.bin.docs   with "documents": N in the sidecar: N little-endian int64 start offsets (the
                   first token of each document: the first 0, strictly increasing, all below
                   "tokens"), for ``data.packing: documents``
    OUT.bin.mask   with "targets": true: one uint8 per token, 1 where it counts in the loss
                   (and "counted": how many do, so a run's start need not read the mask)

What needs every entry read (starts strictly increasing throughout, mask values 0 or 1) is
`dsnd.data.check.verify_token_file`'s, with the SHA-256 and the id range of the tokens.
"""

from __future__ import annotations

import os

import numpy as np

from dsnd.data.token_file import advise, meta_path
from dsnd.data.token_writer import DOCS_SUFFIX, MASK_SUFFIX
from dsnd.errors import UserError

STARTS_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")


def map_starts(path: str, meta: dict) -> np.ndarray | None:
    """The document starts of token file `path` (None when its sidecar records none)."""
    count = meta.get("documents")
    if count is None:
        return None
    starts = _map(path + DOCS_SUFFIX, STARTS_DTYPE, count, f"{count} documents", path)
    first, last, tokens = int(starts[0]), int(starts[-1]), meta["tokens"]
    where = path + DOCS_SUFFIX
    if first != 0:
        raise UserError(f"{where}: the first document starts at token {first}, not 0")
    if last >= tokens:
        raise UserError(
            f"{where}: the last document starts at token {last}, past the "
            f"{tokens} tokens {meta_path(path)} records"
        )
    if count > 1 and not (starts[1] > starts[0] and starts[-1] > starts[-2]):
        raise UserError(
            f"{where}: document starts are not strictly increasing (first "
            f"{int(starts[0])}, {int(starts[1])}; last {int(starts[-2])}, "
            f"{last})"
        )
    return starts


def map_mask(path: str, meta: dict) -> np.ndarray | None:
    """The loss mask of token file `path` (None when its sidecar says no targets)."""
    if not meta.get("targets"):
        return None
    return _map(path + MASK_SUFFIX, MASK_DTYPE, meta["tokens"], f"{meta['tokens']} tokens", path)


def recorded_count(path: str, meta: dict) -> int | None:
    """The counted tokens the sidecar records beside a mask ("counted", written by
    ``dsnd data prepare``; None for a file written without it)."""
    counted = meta.get("counted")
    if counted is None or not meta.get("targets"):
        return None
    if type(counted) is not int or not 0 <= counted <= meta["tokens"]:
        raise UserError(
            f"{meta_path(path)}: counted must be an integer from 0 to its "
            f"{meta['tokens']} tokens, got {str(counted)[:80]}"
        )
    return counted


def _map(where: str, dtype: np.dtype, count: int, says: str, path: str) -> np.ndarray:
    """`where` memory-mapped as `count` entries of `dtype`, after checking its size."""
    if not os.path.isfile(where):
        what = "not a regular file" if os.path.exists(where) else "not found"
        raise UserError(
            f"{where}: {what}, but {meta_path(path)} records {says} in it; write "
            "both again with 'dsnd data prepare'"
        )
    size = os.path.getsize(where)
    if size != count * dtype.itemsize:
        raise UserError(
            f"{where}: {size} bytes hold {size / dtype.itemsize:g} {dtype.name} "
            f"entries, {meta_path(path)} says {says} ({count * dtype.itemsize} "
            "bytes); write it again with 'dsnd data prepare'"
        )
    try:
        return advise(np.memmap(where, dtype=dtype, mode="r"))
    except OSError as e:
        raise UserError(f"{where}: cannot read ({e.strerror or e})") from e
