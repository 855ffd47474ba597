"""Pre-tokenized corpora: token ids in a flat binary file read as a numpy memmap (nanoGPT's and
Megatron's way: nothing is tokenized at training time, and the file is paged in, not loaded).

    corpus.bin        token ids, little-endian uint16 (uint32 when the vocabulary needs it)
    corpus.bin.json   {"dtype", "vocab_size", "tokens", "tokenizer", "source", "sha256"}

`dsnd data prepare INPUT corpus.bin` writes both from a text or JSONL file, with the byte-level
tokenizer or any `transformers` tokenizer in a local directory.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from dsnd.errors import UserError


def meta_path(path: str) -> str:
    return path + ".json"


def read_token_file(path: str, max_tokens: int | None) -> tuple[np.ndarray, dict]:
    """(token ids as a read-only memmap, capped at `max_tokens`; the sidecar's metadata)."""
    try:
        with open(meta_path(path), encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise UserError(f"{meta_path(path)}: cannot read the token file's metadata "
                        f"({e.strerror}); write both with 'dsnd data prepare'") from e  # fmt: skip
    except ValueError as e:
        raise UserError(f"{meta_path(path)}: not valid JSON ({e})") from e
    dtype = np.dtype(meta.get("dtype", "uint16"))
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise UserError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) != meta.get("tokens", len(tokens)):
        raise UserError(f"{path}: {len(tokens)} tokens, its metadata says {meta['tokens']}")
    return (tokens if max_tokens is None else tokens[:max_tokens]), meta


def check_vocab(vocab_size: int | None, model_vocab: int, path: str) -> None:
    if vocab_size is not None and vocab_size > model_vocab:
        raise UserError(f"data.path={path}: tokens from a vocabulary of {vocab_size}, the model "
                        f"has {model_vocab}")  # fmt: skip


def write_token_file(path: str, ids: np.ndarray, vocab_size: int, tokenizer: str,
                     source: str) -> dict:  # fmt: skip
    """Write `ids` and the sidecar; returns the metadata."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    data = np.asarray(ids, dtype=dtype).tobytes()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    meta = {"dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "tokens": len(ids),
            "tokenizer": tokenizer, "source": source,
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    with open(meta_path(path), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return meta
