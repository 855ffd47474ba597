"""Pre-tokenized corpora: token ids in a flat binary file read as a numpy memmap (nanoGPT's and
Megatron's way: nothing is tokenized at training time, and the file is paged in, not loaded).

    corpus.bin        token ids, little-endian uint16 (uint32 when the vocabulary needs it)
    corpus.bin.json   {"dtype", "vocab_size", "tokens", "tokenizer", "source", "sha256"}, and
                      optionally "eot", "documents" and "targets" (`dsnd.data.token_extras`
                      maps the .docs and .mask files these describe)

`dsnd data prepare INPUT corpus.bin` writes both from a text or JSONL file, with the byte-level
tokenizer or any `transformers` tokenizer in a local directory.

The sidecar is input like any other: a hand-edited or stale one is refused here with one line,
because numpy would otherwise read the bytes as whatever dtype it names (float32 trains on
garbage) and a wrong count or vocabulary only shows up as an index error deep in the model.
"""

from __future__ import annotations

import json
import mmap
import os
import re

import numpy as np

from dsnd.errors import UserError

# Token ids are non-negative integers; a signed dtype is allowed (other tools write int32/int64)
# but its minimum is checked (each gathered batch, and dsnd.data.verify). Anything else is
# refused by name.
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
_REQUIRED = {"dtype": str, "vocab_size": int, "tokens": int, "sha256": str}
_OPTIONAL = {"eot": (int, type(None)), "documents": (int,), "targets": (bool,)}
_JSON_TYPES = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    type(None): "null",
}


def meta_path(path: str) -> str:
    return path + ".json"


def check_file(path: str, what: str) -> None:
    """Refuse a missing path or one that is not a regular file (a directory, a FIFO) before
    opening it, so the error names the setting instead of an OS traceback."""
    if not os.path.exists(path):
        raise UserError(f"{what}: file not found: {path}")
    if not os.path.isfile(path):
        raise UserError(f"{what}: not a regular file: {path}")


def read_token_file(path: str, max_tokens: int | None) -> tuple[np.ndarray, dict]:
    """(token ids as a read-only memmap, capped at `max_tokens`; the sidecar's metadata).

    Checks the sidecar's schema and that the file's size matches it, reading no token; the
    checks that read every token (SHA-256, id range) are `dsnd.data.verify.verify_token_file`'s.
    """
    meta = read_meta(path)
    tokens = _map_tokens(path, meta)
    return (tokens if max_tokens is None else tokens[:max_tokens]), meta


def read_meta(path: str) -> dict:
    """The sidecar of token file `path`, schema-checked."""
    where = meta_path(path)
    try:
        with open(where, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise UserError(
            f"{where}: cannot read the token file's metadata "
            f"({e.strerror}); write both with 'dsnd data prepare'"
        ) from e
    except (ValueError, RecursionError) as e:
        raise UserError(f"{where}: not valid JSON ({e})") from e
    _check_meta(meta, where)
    return meta


def _check_meta(meta: object, where: str) -> None:
    """Required keys with their JSON types, a token dtype, sane counts and a hex digest."""
    keys = ", ".join(_REQUIRED)
    if not isinstance(meta, dict):
        raise UserError(f"{where}: expected a JSON object with keys {keys}, got {_json_type(meta)}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise UserError(
            f"{where}: missing {', '.join(missing)} (needs {keys}); "
            "write it again with 'dsnd data prepare'"
        )
    for key, kind in _REQUIRED.items():
        value = meta[key]
        if type(value) is not kind:  # bool is an int subclass, and true is no vocabulary
            got = _json_type(value)
            if not isinstance(value, (dict, list, type(None))):
                got += f" {json.dumps(value)}"
            article = "an" if kind is int else "a"
            raise UserError(f"{where}: {key} must be {article} {_JSON_TYPES[kind]}, got {got}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserError(
            f"{where}: dtype {meta['dtype']!r} is not a token id type; "
            f"expected one of {', '.join(TOKEN_DTYPES)}"
        )
    if meta["vocab_size"] < 1:
        raise UserError(f"{where}: vocab_size must be at least 1, got {meta['vocab_size']}")
    if meta["tokens"] < 0:
        raise UserError(f"{where}: tokens must be at least 0, got {meta['tokens']}")
    if not re.fullmatch(r"[0-9a-f]{64}", meta["sha256"]):
        raise UserError(
            f"{where}: sha256 must be 64 lowercase hex digits, got {meta['sha256'][:80]!r}"
        )
    _check_optional(meta, where)


def _check_optional(meta: dict, where: str) -> None:
    """The optional keys: eot (an id or null), documents (how many int64 starts the .docs file
    beside the tokens holds) and targets (true: a .mask file holds one uint8 per token)."""
    for key, kinds in _OPTIONAL.items():
        if key in meta and type(meta[key]) not in kinds:
            names = " or ".join(_JSON_TYPES[k] for k in kinds)
            got = _json_type(meta[key])
            if not isinstance(meta[key], (dict, list, type(None))):
                got += f" {json.dumps(meta[key])}"
            raise UserError(
                f"{where}: {key} must be {'an' if names[0] in 'aeiou' else 'a'} {names}, got {got}"
            )
    eot, vocab, tokens = meta.get("eot"), meta["vocab_size"], meta["tokens"]
    if eot is not None and not 0 <= eot < vocab:
        raise UserError(f"{where}: eot {eot} is not an id of the vocabulary of {vocab}")
    documents = meta.get("documents")
    if documents is not None and not 1 <= documents <= max(tokens, 1):
        raise UserError(f"{where}: documents must be in 1..tokens ({tokens}), got {documents}")


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _map_tokens(path: str, meta: dict) -> np.ndarray:
    """Memory-map `path` after checking its size against the sidecar (numpy cannot map an empty
    file, and a size that disagrees means the two were not written together)."""
    check_file(path, "token file")
    dtype = np.dtype(meta["dtype"])
    size = os.path.getsize(path)
    if size == 0:
        raise UserError(
            f"{path}: empty (0 bytes), {meta_path(path)} says {meta['tokens']} "
            "tokens; write it again with 'dsnd data prepare'"
        )
    if size % dtype.itemsize:
        raise UserError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens "
            f"({dtype.itemsize} bytes each)"
        )
    count = size // dtype.itemsize
    if count != meta["tokens"]:
        raise UserError(
            f"{path}: {size} bytes hold {count} {dtype} tokens, "
            f"{meta_path(path)} says {meta['tokens']}"
        )
    try:
        return advise(np.memmap(path, dtype=dtype, mode="r"))
    except OSError as e:
        raise UserError(f"{path}: cannot read the token file ({e.strerror or e})") from e


def advise(array: np.ndarray, advice: str = "MADV_RANDOM") -> np.ndarray:
    """Tell the kernel how a memory map will be read; returns `array`. Training reads a token
    file (and its mask and document starts) at random — a shuffled sample, a binary search —
    and the default read-around reads and maps whole readahead windows around each touch
    (read_ahead_kb, 8 MB on some machines): 32 random windows of 256 tokens of a cold 1 GiB
    file mapped 2 MB by default and 0.25 MB with MADV_RANDOM on such a machine, and their
    binary searches 7.3 MB of a 16 MB .docs file against 1.9 MB, which grew with the file.
    tests/unit/test_corpus_scale.py bounds a whole start-up. A full scan asks for
    MADV_SEQUENTIAL instead."""
    handle = getattr(array, "_mmap", None)  # numpy.memmap's own mmap.mmap
    if handle is not None and hasattr(mmap, advice):
        handle.madvise(getattr(mmap, advice))
    return array


def check_vocab(vocab_size: int | None, model_vocab: int, path: str) -> None:
    if vocab_size is not None and vocab_size > model_vocab:
        raise UserError(
            f"data.path={path}: tokens from a vocabulary of {vocab_size}, the model "
            f"has {model_vocab}"
        )
