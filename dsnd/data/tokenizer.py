"""Byte-level tokenizer: the tokenizer that needs no files, no download and no training.

Every string maps to its UTF-8 bytes, so the vocabulary is exactly 256 ids and any text (code,
non-ASCII prose, binary junk) round-trips. It keeps default runs and parity tests free of
tokenizer state; a learned tokenizer can replace it behind the same `encode`/`decode` shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255) and back."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of `text` as a writable 1-D uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Any) -> str:
        """Turn ids (list, numpy array or CPU tensor) back into text.

        A byte sequence cut in the middle of a multi-byte character (a sample window boundary,
        a sampled continuation) decodes with U+FFFD instead of raising.
        """
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"byte token ids must lie in [0, {self.vocab_size}), "
                f"got min {arr.min()} max {arr.max()}"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
