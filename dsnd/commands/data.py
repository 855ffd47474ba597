"""``dsnd data prepare INPUT OUT.bin``: tokenize a text or JSONL file once, into a token file
(`dsnd.data.token_file`) that training memory-maps.

--tokenizer byte (default) is dsnd's byte-level tokenizer (ids 0..255, what the presets use);
--tokenizer DIR loads any `transformers` tokenizer saved in a local directory (nothing is
downloaded); a model trained on it needs a vocabulary at least as large.
"""

from __future__ import annotations

import numpy as np

from dsnd.data.corpus import load_corpus
from dsnd.data.token_file import write_token_file
from dsnd.errors import UserError


def _encode(data: bytes, tokenizer: str) -> tuple[np.ndarray, int]:
    if tokenizer == "byte":
        return np.frombuffer(data, dtype=np.uint8), 256
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokenizer {tokenizer}: not a local transformers tokenizer ({e})") from e
    ids = tok(data.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int64), len(tok)


def run_prepare(source: str, out: str, fmt: str, text_field: str, tokenizer: str) -> int:
    corpus = load_corpus(source, fmt, text_field, max_bytes=None)
    if corpus.vocab_size is not None:
        raise UserError(f"{source}: already a token file")
    ids, vocab = _encode(corpus.tokens.tobytes(), tokenizer)
    meta = write_token_file(out, ids, vocab, tokenizer, source)
    print(f"wrote {out}: {meta['tokens']} tokens ({meta['dtype']}, vocabulary {vocab})")
    return 0
