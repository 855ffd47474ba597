"""Byte-level tokenizer: the tokenizer that needs no files, no download and no training.

Every string maps to its UTF-8 bytes, so the vocabulary is exactly 256 ids and any text (code,
non-ASCII prose, binary junk) round-trips. It keeps default runs and parity tests free of
tokenizer state; a learned tokenizer can replace it behind the same `encode`/`decode` shape.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dsnd.errors import UserError


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


# The files that make a directory hold a tokenizer (config.json and weights alone do not).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")
# What decides the ids a tokenizer gives: two directories with the same of these tokenize alike.
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
BYTE = "byte"


def has_tokenizer(path: str | None) -> bool:
    """Whether directory `path` holds a transformers tokenizer's files."""
    return (
        bool(path)
        and os.path.isdir(path)
        and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_MARKERS)
    )


def model_tokenizer(init_from: str | None, config: str | None) -> str | None:
    """The model's own tokenizer directory: model.init_from's, else model.config's directory's
    (None: the model brings none)."""
    for path in (init_from, config):
        if has_tokenizer(path):
            return path
    return None


def same_tokenizer(a: str, b: str) -> bool:
    """Whether tokenizers `a` and `b` ("byte" or directories) give the same ids: the same name,
    the same directory, or directories whose vocabulary files are byte for byte the same (a copy,
    such as an export's)."""
    if a == b or (BYTE not in (a, b) and os.path.realpath(a) == os.path.realpath(b)):
        return True
    if BYTE in (a, b) or not (os.path.isdir(a) and os.path.isdir(b)):
        return False
    found = False
    for name in _VOCABULARY_FILES:
        fa, fb = os.path.join(a, name), os.path.join(b, name)
        if os.path.isfile(fa) != os.path.isfile(fb):
            return False
        if os.path.isfile(fa):
            with open(fa, "rb") as f, open(fb, "rb") as g:
                if f.read() != g.read():
                    return False
            found = True
    return found


def load_tokenizer(path: str, what: str = "--tokenizer") -> Any:
    """A transformers tokenizer from local directory `path` (`what` names the setting in
    errors). Its loader raises whatever the files provoke (OSError, ValueError, KeyError,
    TypeError, JSONDecodeError), all of them the user's files to fix, so any exception becomes
    one line."""
    if not os.path.isdir(path):
        raise UserError(
            f"{what} {path}: not a directory; expected 'byte' or a local "
            "transformers tokenizer directory"
        )
    try:
        os.listdir(path)
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read the directory ({e.strerror})") from e
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # any failure: see the docstring
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(
            f"{what} {path}: not a local transformers tokenizer ({type(e).__name__}: {first})"
        ) from e


def tokenizer_vocab(tok: Any, ids: np.ndarray) -> int:
    """The vocabulary a token file or corpus of `ids` records: the tokenizer's length, or more
    where its ids have gaps past it (the check would otherwise refuse its own tokens)."""
    return max(len(tok), int(ids.max()) + 1 if len(ids) else 0)
