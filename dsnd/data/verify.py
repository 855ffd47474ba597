"""The full check of a token file, which reads every byte of it: the SHA-256 its sidecar
records, every id within the vocabulary, document starts strictly increasing throughout, mask
values 0 or 1. It is an explicit check, never run at start: a run's start reads the sidecar and
a few entries only (`dsnd.data.token_extras`), and each batch checks the ids it gathers
(`SampleSet`), so start-up does not grow with the file.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dsnd.data.token_extras import map_mask, map_starts, recorded_count
from dsnd.data.token_file import advise, meta_path, read_token_file
from dsnd.data.token_writer import DOCS_SUFFIX, MASK_SUFFIX
from dsnd.errors import UserError

_CHUNK = 1 << 23  # entries per read: bounded memory, large enough to stream fast


def verify_token_file(path: str) -> dict:
    """Refuse (UserError, one line naming the file and the numbers) a token file whose bytes
    its sidecar does not describe; returns the sidecar's metadata."""
    tokens, meta = read_token_file(path, None)
    starts, mask = map_starts(path, meta), map_mask(path, meta)
    for array in (tokens, starts, mask):
        if array is not None:
            advise(array, "MADV_SEQUENTIAL")  # one pass, front to back
    digest, low, high = _scan(tokens)
    sidecar = meta_path(path)
    if digest != meta["sha256"]:
        raise UserError(
            f"{path}: SHA-256 {digest[:16]}... does not match "
            f"{meta['sha256'][:16]}... recorded in {sidecar}; the file changed "
            "after 'dsnd data prepare' wrote it"
        )
    if low < 0:
        raise UserError(f"{path}: smallest token id {low} is negative ({meta['dtype']} tokens)")
    if high >= meta["vocab_size"]:
        raise UserError(
            f"{path}: largest token id {high} >= vocab_size {meta['vocab_size']} "
            f"recorded in {sidecar}; the metadata does not describe these "
            "tokens"
        )
    if starts is not None:
        _verify_starts(starts, path + DOCS_SUFFIX)
    if mask is not None:
        top = max(int(mask[i : i + _CHUNK].max()) for i in range(0, len(mask), _CHUNK))
        if top > 1:
            raise UserError(f"{path + MASK_SUFFIX}: holds {top}; a loss mask is 0 or 1 per token")
        _verify_counted(mask, recorded_count(path, meta), path)
    return meta


def _verify_counted(mask: np.ndarray, recorded: int | None, path: str) -> None:
    """The count a run's start line takes from the sidecar is the mask's."""
    counted = sum(int(np.count_nonzero(mask[i : i + _CHUNK])) for i in range(0, len(mask), _CHUNK))
    if recorded is not None and recorded != counted:
        raise UserError(
            f"{path + MASK_SUFFIX}: counts {counted} tokens, {meta_path(path)} "
            f"records counted {recorded}"
        )


def _verify_starts(starts: np.ndarray, where: str) -> None:
    """Strictly increasing, chunk by chunk (each chunk overlapping the last entry before it)."""
    for lo in range(0, len(starts) - 1, _CHUNK):
        chunk = np.asarray(starts[lo : lo + _CHUNK + 1])
        step = np.diff(chunk)
        if (step <= 0).any():
            at = lo + int(np.argmax(step <= 0))
            raise UserError(
                f"{where}: document starts are not strictly increasing: entry {at} "
                f"is {int(starts[at])}, entry {at + 1} is {int(starts[at + 1])}"
            )


def _scan(tokens: np.ndarray) -> tuple[str, int, int]:
    """(sha256 hex of the bytes, smallest id, largest id) in one pass over a non-empty memmap."""
    sha = hashlib.sha256()
    low, high = None, None
    for start in range(0, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start : start + _CHUNK])
        sha.update(memoryview(chunk))
        lo, hi = int(chunk.min()), int(chunk.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return sha.hexdigest(), low, high
