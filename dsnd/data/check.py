"""The pre-start data check: what would otherwise fail only after every rank has joined the process
group (an index error deep in the embedding, a step of garbage from a mislabelled dtype).

`check_data` reads a corpus's token file once (a SHA-256 and a min/max over the memory map, in
chunks), or loads a text or JSONL corpus as training will (at most `data.max_bytes`: a malformed
record is found here, file:line, not after every rank has started), so every rank can run it
before `init_world`. Each failure is one `UserError` naming the file and the numbers.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dsnd.config.schema import DataConfig
from dsnd.data.corpus import corpus_format, load_corpus
from dsnd.data.token_file import check_vocab, meta_path, read_token_file
from dsnd.data.tokenizer import ByteTokenizer
from dsnd.errors import UserError

_CHUNK_TOKENS = 1 << 23  # per read: bounded memory for min/max, large enough to stream fast


def check_data(data: DataConfig, model_vocab: int) -> None:
    """Refuse a corpus the model cannot train on: a bad path or format, a vocabulary smaller than
    the corpus's token ids, or a token file whose sidecar does not describe it."""
    if corpus_format(data.path, data.format) == "tokens":
        check_token_file(data.path, model_vocab)
    else:
        check_byte_vocab(data.path, model_vocab)
        load_corpus(data.path, data.format, data.text_field, data.max_bytes)


def check_byte_vocab(path: str | None, model_vocab: int) -> None:
    """A byte corpus (text, JSONL, the stdlib sources) may hold any of the 256 byte values, so
    the model needs all of them; the text is not read to find out which occur."""
    need = ByteTokenizer.vocab_size
    if model_vocab < need:
        name = path if path is not None else "null (the Python standard library's sources)"
        raise UserError(f"data.path={name}: byte tokens have ids up to {need - 1} >= "
                        f"model.vocab_size {model_vocab} (set model.vocab_size to at "
                        f"least {need})")  # fmt: skip


def check_token_file(path: str, model_vocab: int) -> None:
    """The sidecar's schema and sizes (`read_token_file`), then its SHA-256 and vocabulary
    against the tokens themselves, then its vocabulary against the model's."""
    tokens, meta = read_token_file(path, None)
    digest, low, high = _scan(tokens)
    sidecar = meta_path(path)
    if digest != meta["sha256"]:
        raise UserError(f"{path}: SHA-256 {digest[:16]}... does not match "
                        f"{meta['sha256'][:16]}... recorded in {sidecar}; the file changed "
                        "after 'dsnd data prepare' wrote it")  # fmt: skip
    if low < 0:
        raise UserError(f"{path}: smallest token id {low} is negative ({meta['dtype']} tokens)")
    if high >= meta["vocab_size"]:
        raise UserError(f"{path}: largest token id {high} >= vocab_size {meta['vocab_size']} "
                        f"recorded in {sidecar}; the metadata does not describe these "
                        "tokens")  # fmt: skip
    check_vocab(meta["vocab_size"], model_vocab, path)


def _scan(tokens: np.ndarray) -> tuple[str, int, int]:
    """(sha256 hex of the bytes, smallest id, largest id) in one pass over a non-empty memmap."""
    sha = hashlib.sha256()
    low, high = None, None
    for start in range(0, len(tokens), _CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + _CHUNK_TOKENS])
        sha.update(memoryview(chunk))
        lo, hi = int(chunk.min()), int(chunk.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return sha.hexdigest(), low, high
