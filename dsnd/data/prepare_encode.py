"""Tokenizing `dsnd data prepare`'s batches, in this process or in worker processes, in input
order whatever the number of workers.

Workers are a `multiprocessing` pool, each loading the tokenizer once. Batches go out with
``apply_async`` and come back in submission order from a window of at most `WINDOW` batches
per worker: ``Pool.imap`` would keep the order too, but its feeder thread reads the whole input
ahead into the task queue when the workers are slower than the reader, which is most of the
time, so memory would grow with the input. Each worker tokenizes with one thread (a tokenizer's
own threads in every worker would oversubscribe the cores).

Bytes need no workers: their ids are the bytes themselves.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsnd.data.chat import render_conversation
from dsnd.data.prepare_input import Batch
from dsnd.data.tokenizer import BYTE, load_tokenizer
from dsnd.errors import UserError

WINDOW = 2  # batches in flight per worker


@dataclass
class Encoded:
    """A batch's ids back to back (uint8 for bytes, else uint32), each piece's count of them,
    whether each counts in the loss (chat data; None: all do), the bytes of text they are of."""

    ids: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None
    text_bytes: int

    def split(self) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """(ids, mask) of each piece, in order."""
        ends = np.cumsum(self.lengths)
        for a, b in zip(ends - self.lengths, ends, strict=True):
            yield self.ids[a:b], None if self.mask is None else self.mask[a:b]


_tok: Any = None  # this process's tokenizer (None: bytes)
_chat = False


def use_tokenizer(tok: Any, chat: bool) -> None:
    """Tokenize this process's batches with `tok` (None: bytes), as chat data if `chat`."""
    global _tok, _chat
    _tok, _chat = tok, chat


def _start_worker(tokenizer: str, chat: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: see the docstring
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    use_tokenizer(None if tokenizer == BYTE else load_tokenizer(tokenizer), chat)


def encode(values: list[Any]) -> Encoded:
    """The ids of `values` (UTF-8 bytes of text, or conversations' messages lists) with the
    process's tokenizer; a conversation's errors name its line or row."""
    if _tok is None:
        lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
        ids = np.frombuffer(b"".join(values), np.uint8)
        return Encoded(ids, lengths, None, len(ids))
    if _chat:
        return _encode_chat(values)
    texts = [v.decode("utf-8", "replace") for v in values]
    lists = _tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)[
        "input_ids"
    ]  # verbose: no warning for a document over the
    # model's context, which training cuts into samples anyway
    lengths = np.fromiter((len(x) for x in lists), np.int64, len(lists))
    ids = np.fromiter(itertools.chain.from_iterable(lists), np.uint32, int(lengths.sum()))
    return Encoded(ids, lengths, None, sum(len(v) for v in values))


def _encode_chat(conversations: list[tuple[str, Any]]) -> Encoded:
    ids: list[int] = []
    mask: list[bool] = []
    lengths, size = [], 0
    for where, messages in conversations:
        one, counts = render_conversation(_tok, messages, where)
        ids += one
        mask += counts
        lengths.append(len(one))
        size += sum(len(str(m.get("content", "")).encode("utf-8", "replace")) for m in messages)
    return Encoded(
        np.asarray(ids, np.uint32), np.asarray(lengths, np.int64), np.asarray(mask, np.uint8), size
    )


def _payload(batch: Batch, chat: bool) -> list[Any]:
    """What a worker needs of `batch`: the values (a conversation with its line or row)."""
    return list(zip(batch.wheres, batch.values, strict=True)) if chat else batch.values


def encoded(
    batches: Iterator[Batch], tokenizer: str, tok: Any, chat: bool, workers: int
) -> Iterator[tuple[Batch, Encoded]]:
    """Each batch of `batches` with its ids, in order; tokenized by `workers` processes, or here
    (with `tok`, already loaded) for one worker and for bytes. A failure is the earliest batch's:
    a reading error is raised only after the batches before it are tokenized."""
    if workers <= 1 or tokenizer == BYTE:
        use_tokenizer(None if tokenizer == BYTE else tok, chat)
        for batch in batches:
            yield batch, encode(_payload(batch, chat))
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(workers, _start_worker, (tokenizer, chat)) as pool:
        pending: deque = deque()
        stream = iter(batches)
        while True:
            try:
                batch = next(stream, None)
            except UserError:  # reading failed: an earlier batch's error comes first
                while pending:
                    pending.popleft()[1].get()
                raise
            if batch is None:
                break
            values = _payload(batch, chat)
            batch.values = []  # the worker has them; keep only where and firsts here
            pending.append((batch, pool.apply_async(encode, (values,))))
            if len(pending) >= WINDOW * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()
