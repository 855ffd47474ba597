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

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data.corpus import corpus_format
from dsnd.data.sources import data_tokenizer, load_data
from dsnd.data.token_file import check_vocab, meta_path, read_meta, read_token_file
from dsnd.data.tokenizer import BYTE, ByteTokenizer, has_tokenizer, same_tokenizer
from dsnd.errors import UserError

_CHUNK_TOKENS = 1 << 23  # per read: bounded memory for min/max, large enough to stream fast


def check_data(data: DataConfig, model_vocab: int, model: ModelConfig | None = None) -> None:
    """Refuse a corpus the model cannot train on: a bad path or format, a vocabulary smaller than
    the corpus's token ids, a token file whose sidecar does not describe it, data not tokenized
    with the tokenizer of the pretrained weights of `model.init_from`, or document packing of
    data without document boundaries."""
    model = model or ModelConfig()
    fmt = corpus_format(data.path, data.format)
    if fmt == "tokens":
        tokenizer = str(read_meta(data.path).get("tokenizer") or BYTE)
        check_tokenizer_match(data, model, tokenizer, f"{meta_path(data.path)} names")
        _check_packing(data, None)
        check_token_file(data.path, model_vocab)
        return
    tokenizer = data_tokenizer(data, model)
    check_tokenizer_match(data, model, tokenizer, "the data is tokenized with")
    if tokenizer == BYTE:
        check_byte_vocab(data.path, model_vocab)
    corpus = load_data(data, model)
    _check_packing(data, corpus.documents)
    check_vocab(corpus.vocab_size, model_vocab, data.path)


def check_tokenizer_match(data: DataConfig, model: ModelConfig, tokenizer: str,
                          said: str) -> None:  # fmt: skip
    """Pretrained weights read ids as their tokenizer's: data with ids of another (bytes, by
    default) trains them on scrambled text, so it is refused unless
    data.allow_vocab_mismatch says it is meant."""
    own = model.init_from if has_tokenizer(model.init_from) else None
    if own is None or data.allow_vocab_mismatch or same_tokenizer(tokenizer, own):
        return
    name = data.path if data.path is not None else "null (the Python standard library's sources)"
    what = "byte tokens" if tokenizer == BYTE else f"the tokenizer of {tokenizer}"
    raise UserError(f"data.path={name}: {said} {what}, but model.init_from={own} has its own "
                    "tokenizer; set data.vocab: model to tokenize the data with it, or "
                    "data.allow_vocab_mismatch: true to train on it as is")  # fmt: skip


def _check_packing(data: DataConfig, documents: np.ndarray | None) -> None:
    if data.packing == "documents" and documents is None:
        name = data.path if data.path is not None else "null (the Python standard library)"
        raise UserError(f"data.packing=documents: data.path={name} records no document "
                        "boundaries; use JSONL, a Hugging Face dataset or chat data")  # fmt: skip


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
