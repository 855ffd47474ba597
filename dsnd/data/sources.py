"""The training data a run's `data` section names, tokenized as it says: every source
(`dsnd.data.corpus`'s byte corpora and token files, Hugging Face datasets, chat JSONL) as one
`Corpus` of token ids, with the documents they belong to and which of them count in the loss.

Which tokenizer (`data.vocab`): bytes for text, JSONL and the default corpus unless told
otherwise, as before tokenizers existed; the model's own (model.init_from's directory, else
model.config's) for a Hugging Face dataset and chat data, which are meant for a pretrained
model; `model`, `byte` or a directory to choose. Each document tokenized with a tokenizer ends
with its EOS token when it has one, so that the model learns where documents end and a stream
of them still shows the boundary. Every rank tokenizes the data itself, before the process
group starts (all of it, unless data.max_bytes caps the text read: then a line says so). A
blend of token files (`data.blend`) is `dsnd.data.blend_files`'.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data.blend import BlendedCorpus
from dsnd.data.blend_files import load_blend
from dsnd.data.chat import chat_corpus
from dsnd.data.corpus import (
    Corpus,
    cap_note,
    corpus_format,
    fingerprint,
    join_documents,
    jsonl_values,
    load_corpus,
    text_parts,
)
from dsnd.data.documents import documents_corpus
from dsnd.data.hf_dataset import column
from dsnd.data.tokenizer import BYTE, load_tokenizer, model_tokenizer
from dsnd.errors import UserError

TOKENIZED = ("hf", "chat")  # formats that take the model's tokenizer by default


def data_tokenizer(data: DataConfig, model: ModelConfig) -> str:
    """The tokenizer the data is (to be) tokenized with: "byte" or a directory (a token file's
    is the one its sidecar names: see `load_data`)."""
    fmt = corpus_format(data.path, data.format)
    own = model_tokenizer(model.init_from, model.config)
    choice = data.vocab
    if choice is None:
        choice = "model" if fmt in TOKENIZED else BYTE
    if choice == "model":
        if own is None:
            raise UserError(
                f"data.vocab={data.vocab or 'null'}: {_why_model(fmt)} the "
                "model's tokenizer, and neither model.init_from nor model.config "
                "names a directory with one; set data.vocab to a tokenizer "
                "directory"
            )
        return own
    return choice


def _why_model(fmt: str) -> str:
    return f"{fmt} data is tokenized with" if fmt in TOKENIZED else "asks for"


def load_data(data: DataConfig, model: ModelConfig) -> Corpus | BlendedCorpus:
    """The corpus `data` names, tokenized with `data_tokenizer`; Raises `UserError` for bad
    files, records and settings (each one line naming the file, row or line, and key)."""
    if data.blend is not None:
        return load_blend(data)
    fmt = corpus_format(data.path, data.format)
    if fmt == "tokens":
        return load_corpus(data.path, fmt, data.text_field, data.max_bytes)
    corpus = _load_text(data, model, fmt)
    if data.max_bytes is not None and not corpus.notes:
        corpus.notes = (cap_note(data.max_bytes, data.path, None),)
    return corpus


def _load_text(data: DataConfig, model: ModelConfig, fmt: str) -> Corpus:
    """Text, JSONL, a dataset or chat data, tokenized with `data_tokenizer`."""
    tokenizer = data_tokenizer(data, model)
    if tokenizer == BYTE:
        if fmt == "chat":
            raise UserError(
                "data.format=chat: byte tokens have no chat template; set "
                "data.vocab to a tokenizer with one (or null: the model's)"
            )
        if fmt != "hf":
            return load_corpus(data.path, fmt, data.text_field, data.max_bytes)
        parts = text_parts(_texts(data, fmt), data.text_field, data.max_bytes)
        joined, documents = join_documents(parts, data.max_bytes)
        tokens = np.frombuffer(joined, dtype=np.uint8).copy()
        return Corpus(tokens, data.path, fingerprint(tokens), documents=documents)
    tok = load_tokenizer(tokenizer, "data.vocab")
    if fmt == "chat":
        values = _values(data, "messages", "the chat data's messages")
        return chat_corpus(values, tok, data.max_bytes, data.path, tokenizer)
    return _tokenized(_texts(data, fmt), tok, data, tokenizer)


def _values(data: DataConfig, field: str, key: str) -> Iterator[tuple[str, Any]]:
    if corpus_format(data.path, "auto") == "hf":
        return column(data.path, data.split, field, key)
    return jsonl_values(data.path, field)


def _texts(data: DataConfig, fmt: str) -> Iterator[tuple[str, Any]]:
    """(where, text) of each document of a text file (one document), JSONL or dataset."""
    if fmt == "text":
        with open(data.path, "rb") as f:
            return iter([(data.path, f.read(data.max_bytes).decode("utf-8", "replace"))])
    return _values(data, data.text_field, "data.text_field")


def _tokenized(
    texts: Iterator[tuple[str, Any]], tok: Any, data: DataConfig, tokenizer: str
) -> Corpus:
    """Each text's ids (no special tokens but a closing EOS) in order, until data.max_bytes of
    text are read; the document index of every id."""
    end = [] if tok.eos_token_id is None else [tok.eos_token_id]
    pieces: list[list[int]] = []
    read = 0
    for where, text in texts:
        if not isinstance(text, str):
            raise UserError(
                f"{where}: field {data.text_field!r} must be a string, got {type(text).__name__}"
            )
        pieces.append(tok(text, add_special_tokens=False)["input_ids"] + end)
        read += len(text.encode("utf-8", "replace"))
        if data.max_bytes is not None and read >= data.max_bytes:
            break
    return documents_corpus(pieces, None, data.path, tokenizer, tok)
