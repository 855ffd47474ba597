"""Which positions of a sequence each context-parallel rank holds (pure).

ring: the sequence is cut into 2*cp equal chunks and rank i holds chunks i and 2*cp-1-i. Under
a causal mask a query attends only to earlier keys, so with plain contiguous slices the last
rank would do cp times the first rank's work; pairing an early chunk with a late one gives
every rank the same number of (query, key) pairs.

ulysses: contiguous slices. The all-to-all reassembles whole sequences by concatenating the
ranks' slices in rank order, which is the sequence itself only when the slices are contiguous.
"""

from __future__ import annotations

import functools

IMPLS = ("ring", "ulysses")


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) a ring rank holds, in sequence order."""
    return rank, 2 * cp - 1 - rank


@functools.cache  # asked by every block of every forward, with the same few arguments
def slice_positions(seq: int, cp: int, rank: int, impl: str) -> tuple[int, ...]:
    """The positions (indices into the full sequence of length `seq`) rank `rank` of `cp` holds,
    in the order it holds them."""
    if impl not in IMPLS:
        raise ValueError(f"unknown context-parallel implementation {impl!r}")
    if impl == "ulysses":
        size = seq // cp
        return tuple(range(rank * size, (rank + 1) * size))
    size = seq // (2 * cp)
    first, last = (range(c * size, (c + 1) * size) for c in chunks_of(cp, rank))
    return (*first, *last)


def divisor(cp: int, impl: str) -> int:
    """What the sequence length must divide by."""
    return 2 * cp if impl == "ring" else cp
