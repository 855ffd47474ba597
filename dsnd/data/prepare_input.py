"""What `dsnd data prepare` reads, as a stream of pieces in bounded memory: each piece is part
of a document (``first`` where one starts), grouped into batches for the tokenizer.

* a text file is one document, read in chunks of `CHUNK` bytes; for a `transformers` tokenizer
  each chunk ends after a line break followed by a non-space byte where it has one (else before
  a whitespace byte, else at a character boundary), where tokenizers do not join text; ids can
  differ from tokenizing the file whole only at these cuts, one per MB (a tokenizer that starts
  every text with a space marker adds one there);
* a JSONL line or a dataset row is a document: its text field (UTF-8 bytes, checked here so an
  error names the file and line) or, for chat data, its ``messages``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dsnd.data.corpus import _text_bytes_of, jsonl_values
from dsnd.data.hf_dataset import column, is_dataset

CHUNK = 1 << 20  # bytes of a text file per piece
BATCH_BYTES = 1 << 20  # text per batch sent to a tokenizer worker
BATCH_ITEMS = 1024  # documents per batch (conversations: `CHAT_ITEMS`)
CHAT_ITEMS = 64


@dataclass
class Batch:
    """Pieces for one tokenizer call: whether each starts a document, where it is (file:line,
    dataset row) and its value (UTF-8 bytes, or a conversation's messages)."""

    firsts: list[bool] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    size: int = 0  # bytes of text


def pieces(
    path: str, fmt: str, text_field: str, split: str, cut_lines: bool
) -> Iterator[tuple[bool, str, Any]]:
    """(starts a document, where, value) of every piece of `path` read as `fmt` (text, jsonl,
    hf or chat); `cut_lines`: cut text files where a tokenizer is unlikely to join across."""
    if fmt == "text":
        for k, chunk in enumerate(text_chunks(path, cut_lines)):
            yield k == 0, path, chunk
        return
    chat = fmt == "chat"
    name = "messages" if chat else text_field
    if fmt == "hf" or (chat and is_dataset(path)):
        values = column(path, split, name, "the chat data's messages" if chat else "--text-field")
    else:
        values = jsonl_values(path, name)
    for where, value in values:
        yield True, where, value if chat else _text_bytes_of(value, where, text_field)


def text_chunks(path: str, cut_lines: bool, size: int = CHUNK) -> Iterator[bytes]:
    """The bytes of file `path` in chunks of about `size` (see the module's docstring)."""
    with open(path, "rb") as f:
        buf = f.read(size)
        while buf:
            more = f.read(size)
            if not more:  # the end: nothing to join across
                yield buf
                return
            cut = cut_point(buf) if cut_lines else len(buf)
            if cut:
                yield buf[:cut]
            buf = buf[cut:] + more


def cut_point(buf: bytes) -> int:
    """Where to end a chunk of `buf` (the rest starts the next one): after the last line break
    followed by a non-space byte, else before the last run of whitespace, else before the last
    UTF-8 character that may be incomplete; 0 when the whole buffer should wait."""
    line = buf.rfind(b"\n", 0, len(buf) - 1)
    while line >= 0:
        if not buf[line + 1 : line + 2].isspace():
            return line + 1
        line = buf.rfind(b"\n", 0, line)
    space = max(buf.rfind(c) for c in (b" ", b"\n", b"\t", b"\r"))
    while space > 0 and buf[space - 1 : space].isspace():
        space -= 1  # before the whole run: tokenizers join spaces to the word after them
    if space > 0:
        return space
    end = len(buf)
    while end > 0 and len(buf) - end < 4 and (buf[end - 1] & 0xC0) == 0x80:
        end -= 1  # continuation bytes: back up to the character's first byte
    if end > 0 and buf[end - 1] >= 0xC0:
        end -= 1  # a lead byte whose continuation is still to come
    return end


def batches(stream: Iterator[tuple[bool, str, Any]], chat: bool) -> Iterator[Batch]:
    """The pieces of `stream` grouped by up to `BATCH_BYTES` of text and `BATCH_ITEMS`
    documents (`CHAT_ITEMS` conversations)."""
    most = CHAT_ITEMS if chat else BATCH_ITEMS
    batch = Batch()
    for first, where, value in stream:
        batch.firsts.append(first)
        batch.wheres.append(where)
        batch.values.append(value)
        batch.size += 0 if chat else len(value)
        if len(batch.values) >= most or batch.size >= BATCH_BYTES:
            yield batch
            batch = Batch()
    if batch.values:
        yield batch
