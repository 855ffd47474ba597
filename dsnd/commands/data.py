"""``dsnd data prepare INPUT OUT.bin``: tokenize a text or JSONL file once, into a token file
(`dsnd.data.token_file`) that training memory-maps.

--tokenizer byte (default) is dsnd's byte-level tokenizer (ids 0..255, what the presets use);
--tokenizer DIR loads any `transformers` tokenizer saved in a local directory (nothing is
downloaded); a model trained on it needs a vocabulary at least as large.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from dsnd.data.corpus import corpus_format, load_corpus
from dsnd.data.token_file import meta_path, write_token_file
from dsnd.data.tokenizer import load_tokenizer, tokenizer_vocab
from dsnd.errors import UserError


def _encode(data: bytes, tokenizer: str) -> tuple[np.ndarray, int]:
    if tokenizer == "byte":
        return np.frombuffer(data, dtype=np.uint8), 256
    tok = load_tokenizer(tokenizer)
    ids = np.asarray(tok(data.decode("utf-8", errors="replace"),
                         add_special_tokens=False)["input_ids"], dtype=np.int64)  # fmt: skip
    return ids, tokenizer_vocab(tok, ids)


def _check_output(source: str, out: str) -> None:
    """Writing OUT or its sidecar over INPUT would destroy the input mid-run."""
    for target in (out, meta_path(out)):
        if os.path.isfile(target) and os.path.samefile(source, target):
            raise UserError(f"OUT {out}: writing {target} would overwrite INPUT {source}")


def run_prepare(source: str, out: str, fmt: str, text_field: str, tokenizer: str) -> int:
    corpus_format(source, fmt, what="INPUT")  # "INPUT: file not found", not "data.path: ..."
    _check_output(source, out)
    corpus = load_corpus(source, fmt, text_field, max_bytes=None)
    if corpus.vocab_size is not None:
        raise UserError(f"{source}: already a token file")
    if not len(corpus.tokens):
        raise UserError(f"INPUT {source}: no text to tokenize (0 bytes)")
    ids, vocab = _encode(corpus.tokens.tobytes(), tokenizer)
    if not len(ids):
        raise UserError(f"INPUT {source}: --tokenizer {tokenizer} made no tokens of its "
                        f"{len(corpus.tokens)} bytes")  # fmt: skip
    # the tokenizer's absolute path: training compares it with model.init_from's wherever it runs
    named = tokenizer if tokenizer == "byte" else os.path.abspath(tokenizer)
    meta = write_token_file(out, ids, vocab, named, source)
    print(f"wrote {out}: {meta['tokens']} tokens ({meta['dtype']}, vocabulary {vocab})")
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd data prepare``, the one data command."""
    return run_prepare(args.source, args.out, args.format, args.text_field, args.tokenizer)
