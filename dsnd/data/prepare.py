"""`dsnd data prepare`'s pipeline: read documents (`dsnd.data.prepare_input`), tokenize them in
batches (`dsnd.data.prepare_encode`), write the tokens as they come (`dsnd.data.token_writer`),
in memory that does not grow with the input.

Between documents, as training reads the same input (`dsnd.data.sources`), so a prepared file
trains on the same tokens:

* a `transformers` tokenizer closes each document of text with its EOS token (the sidecar's
  "eot"; none when the tokenizer has none);
* bytes have no spare id (all 256 are bytes, which the byte presets' vocabulary of 256 holds
  exactly): JSONL and dataset documents are joined with a blank line, which belongs to the
  document before it, and "eot" is null;
* chat conversations end with the template's own end-of-turn tokens: nothing is added.

Every document's first token is recorded (OUT.bin.docs), so `data.packing: documents` can keep
them apart; chat data also records which tokens count in the loss (OUT.bin.mask).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from dsnd.data.prepare_encode import Encoded, encoded
from dsnd.data.prepare_input import Batch, batches, pieces
from dsnd.data.token_writer import TokenWriter, token_dtype
from dsnd.data.tokenizer import BYTE
from dsnd.errors import UserError

_BLANK_LINE = np.frombuffer(b"\n\n", np.uint8)
_NONE = np.zeros(0, np.uint8)


@dataclass
class Spec:
    """What to prepare: `path` read as `fmt` (text, jsonl, hf or chat), tokenized with
    `tokenizer` ("byte" or a directory; `tok` the loaded tokenizer, None for bytes)."""

    path: str
    fmt: str
    text_field: str = "text"
    split: str = "train"
    tokenizer: str = BYTE
    tok: Any = None

    @property
    def chat(self) -> bool:
        return self.fmt == "chat"

    def eot(self) -> int | None:
        """The id closing each document (see the module's docstring)."""
        return None if self.tok is None or self.chat else self.tok.eos_token_id

    def joins(self) -> tuple[np.ndarray, np.ndarray]:
        """(the ids after each document, the ids between two documents)."""
        eot = self.eot()
        if eot is not None:
            return np.array([eot], np.uint32), _NONE
        return _NONE, _BLANK_LINE if self.tok is None and self.fmt != "text" else _NONE


class Progress:
    """A line on stderr: documents, tokens and MB of text so far, and MB/s. On a terminal it is
    rewritten in place twice a second; elsewhere (a log, a pipe) it is a line every `every`
    seconds, so short runs print none."""

    def __init__(self, stream: TextIO | None = None, every: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.every = every if every is not None else (0.5 if self.live else 10.0)
        self.start = self.last = time.monotonic()
        self.shown = False
        self.documents = self.tokens = self.text_bytes = 0

    def update(self, documents: int, tokens: int, text_bytes: int) -> None:
        self.documents, self.tokens, self.text_bytes = documents, tokens, text_bytes
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._show()

    def _show(self) -> None:
        end = "\r" if self.live else "\n"
        print(
            f"{self.line()}\033[K" if self.live else self.line(),
            end=end,
            file=self.stream,
            flush=True,
        )
        self.shown = True

    def line(self) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        mb = self.text_bytes / 1e6
        return (
            f"prepare: {self.documents} documents, {self.tokens} tokens, {mb:.1f} MB of "
            f"text, {mb / seconds:.1f} MB/s"
        )

    def close(self) -> None:
        """The last counts, where a line was shown (once: later calls print nothing)."""
        if self.shown:
            self._show()
            if self.live:
                print(file=self.stream, flush=True)
        self.shown = False
        self.every = float("inf")


def assemble(
    spec: Spec, stream: Iterator[tuple[Batch, Encoded]], progress: Progress | None = None
) -> Iterator[tuple[bool, str, np.ndarray, np.ndarray | None]]:
    """(starts a document, where, ids, mask) of every piece of `stream`, with the ids that
    close a document (`Spec.joins`) after its last piece."""
    after, between = spec.joins()
    closing = np.concatenate([after, between]).astype(np.uint32)
    documents = tokens = text_bytes = 0
    for batch, enc in stream:
        for first, where, (ids, mask) in zip(batch.firsts, batch.wheres, enc.split(), strict=True):
            if first and documents:
                tokens += len(closing)
                yield False, where, closing, None
            documents += first
            yield first, where, ids, mask
        tokens += len(enc.ids)
        text_bytes += enc.text_bytes
        if progress is not None:
            progress.update(documents, tokens, text_bytes)
    if documents and len(after):
        yield False, "", after, None


def encoded_stream(spec: Spec, workers: int) -> Iterator[tuple[Batch, Encoded]]:
    read = pieces(spec.path, spec.fmt, spec.text_field, spec.split, spec.tok is not None)
    return encoded(batches(read, spec.chat), spec.tokenizer, spec.tok, spec.chat, workers)


def prepare(spec: Spec, out: str, workers: int, progress: Progress) -> tuple[dict, int]:
    """Write `spec`'s tokens to token file `out`; returns its sidecar's metadata and how many
    tokens count in the loss. A failure (bad input, no tokens, chat data with nothing to
    count, a full disk, Ctrl-C) removes what was written."""
    writer = TokenWriter(out, _dtype(spec), targets=spec.chat)
    try:
        for first, _, ids, mask in assemble(spec, encoded_stream(spec, workers), progress):
            if first:
                writer.begin_document()
            writer.add(ids, mask)
        progress.close()
        _check_written(spec, writer, progress.text_bytes)
        vocab = 256 if spec.tok is None else max(len(spec.tok), writer.max_id + 1)
        return writer.finish(vocab, spec.tokenizer, spec.path, spec.eot()), writer.counted
    except BaseException:
        progress.close()
        writer.abort()
        raise


def _dtype(spec: Spec) -> np.dtype:
    if spec.tok is None:
        return token_dtype(256)
    ids = spec.tok.get_vocab().values()
    return token_dtype(max(len(spec.tok), max(ids, default=-1) + 1))


def _check_written(spec: Spec, writer: TokenWriter, text_bytes: int) -> None:
    where = f"INPUT {spec.path}"
    if not writer.tokens:
        if not text_bytes:
            raise UserError(f"{where}: no text to tokenize (0 bytes)")
        raise UserError(
            f"{where}: --tokenizer {spec.tokenizer} made no tokens of its {text_bytes} bytes"
        )
    if spec.chat and not writer.counted:
        raise UserError(
            f"{where}: no token of its {writer.documents} conversations counts in "
            "the loss (no assistant turn); chat data trains on the assistant's "
            "tokens"
        )
