"""Tokenized documents as one corpus: their ids back to back, the document each id belongs to,
and (for chat data) which ids count as prediction targets."""

from __future__ import annotations

from typing import Any

import numpy as np

from dsnd.data.corpus import Corpus, fingerprint
from dsnd.data.tokenizer import tokenizer_vocab
from dsnd.errors import UserError


def documents_corpus(
    pieces: list[list[int]], targets: list[list[bool]] | None, name: str, tokenizer: str, tok: Any
) -> Corpus:
    """One corpus of documents `pieces` (token ids each), with their target masks if given."""
    if not pieces or not any(pieces):
        raise UserError(f"data.path={name}: no documents with tokens to train on")
    tokens = np.fromiter((i for p in pieces for i in p), dtype=np.int64)
    documents = np.repeat(np.arange(len(pieces), dtype=np.int32), [len(p) for p in pieces])
    mask = None
    if targets is not None:
        mask = np.fromiter((t for p in targets for t in p), dtype=bool, count=len(tokens))
    vocab = tokenizer_vocab(tok, tokens)
    tokens = tokens.astype(np.uint32 if vocab > 2**16 else np.uint16)
    return Corpus(
        tokens,
        name,
        fingerprint(tokens, mask),
        vocab_size=vocab,
        targets=mask,
        documents=documents,
        tokenizer=tokenizer,
    )
