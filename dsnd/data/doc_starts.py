"""Document boundaries as the first token index of each document, turned into per-token document
ids only for the windows a batch gathers.

A prepared token file of any size records its documents this way (``OUT.bin.docs``: one int64
per document, memory-mapped): a per-token id array would be 4 bytes per token read at start,
while a batch needs the ids of its own ``micro x (seq_len + 1)`` tokens only — one binary search
each (`np.searchsorted` reads about log2(documents) entries of the map per token).
"""

from __future__ import annotations

import numpy as np


class DocumentStarts:
    """The documents of a token stream: `starts` (ascending int64, the first 0) are the index of
    each document's first token; token t belongs to document ``searchsorted(starts, t, "right")
    - 1``. `offset` shifts the stream: a slice ``[lo:hi]`` of the tokens keeps its documents as
    ``DocumentStarts(starts, offset + lo)``."""

    def __init__(self, starts: np.ndarray, offset: int = 0) -> None:
        if starts.dtype != np.int64:  # searchsorted would convert (copy) the whole map first
            raise ValueError(f"document starts must be int64, got {starts.dtype}")
        self.starts = starts
        self.offset = offset

    def __len__(self) -> int:
        """The number of documents of the whole stream."""
        return len(self.starts)

    def __getitem__(self, key: slice) -> DocumentStarts:
        """The documents of tokens ``[key.start:key.stop]`` (a slice without a step)."""
        if not isinstance(key, slice) or key.step not in (None, 1) or (key.start or 0) < 0:
            raise TypeError(f"document starts take a forward slice of tokens, got {key!r}")
        return DocumentStarts(self.starts, self.offset + (key.start or 0))

    def window_ids(self, first: np.ndarray, width: int) -> np.ndarray:
        """(len(first), width) int64: the document of tokens ``first[i] + j`` (j < width) of
        this stream (ids count from the first document of the whole file)."""
        first = np.asarray(first, dtype=np.int64) + self.offset
        positions = first[:, None] + np.arange(width, dtype=np.int64)
        return np.searchsorted(self.starts, positions, side="right").astype(np.int64) - 1
