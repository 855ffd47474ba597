"""Load a training corpus as one flat array of tokens.

Four sources:

* no path: the first `STDLIB_BYTES` of the Python standard library's own ``.py`` sources — real,
  varied text present on every machine that runs dsnd, so a first run and every test need no
  download; the limit is the default corpus's own (its whole is about 11 MB, and tests and first
  runs want a small, fast one), not ``data.max_bytes``;
* a plain text file: its raw bytes, read into memory;
* a JSONL file: one JSON object per line, the ``text_field`` of each joined with a blank line;
* a pre-tokenized ``.bin`` file (`dsnd.data.token_file`) of any size: memory-mapped, with its
  document starts and loss mask when it has them, and nothing read at start but the sidecar and
  a few entries — start-up time and memory do not grow with the file.

``max_bytes`` (``data.max_bytes``) is no cap unless given; a given cap is said in one line
(`Corpus.notes`, logged at start). JSONL records are documents: the corpus records which
document each byte belongs to, for ``data.packing: documents``. Hugging Face datasets, chat
data and text tokenized with a `transformers` tokenizer are `dsnd.data.sources`'.

The fingerprint goes into checkpoint manifests so a resume can tell that it is reading the same
data it was trained on: the sha256 of the tokens (for a token file the one its sidecar records,
written once by ``dsnd data prepare``, not computed again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from dsnd.data.doc_starts import DocumentStarts
from dsnd.data.hf_dataset import is_dataset
from dsnd.data.token_extras import map_mask, map_starts, recorded_count
from dsnd.data.token_file import check_file, read_token_file
from dsnd.errors import UserError

FORMATS = ("auto", "text", "jsonl", "tokens", "hf", "chat")
_T = TypeVar("_T")

# Directories of the stdlib tree that are not "the standard library's own sources": third-party
# packages, the (huge, repetitive) test suites, and tooling that would dominate the first MBs.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
STDLIB_BYTES = 4_000_000  # the default corpus: this much of the stdlib's sources (docstring)
_DOC_SEPARATOR = b"\n\n"  # between JSONL records
_FILE_SEPARATOR = b"\n"  # between stdlib source files


@dataclass
class Corpus:
    """A loaded corpus.

    tokens: 1-D token ids (uint8 for the byte tokenizer; a read-only memmap for a token file).
    name: where it came from (the path, or ``python3.X-stdlib``), for logs and manifests.
    fingerprint: sha256 hex of the token bytes (a token file's: its sidecar's), to detect a
    changed corpus on resume.
    """

    tokens: np.ndarray
    name: str
    fingerprint: str
    vocab_size: int | None = None  # a pre-tokenized file's vocabulary (None: bytes, 256)
    # whether each token counts as a prediction target (None: all do); chat data's assistant
    # tokens, say (bool, or a token file's uint8 mask: nonzero counts)
    targets: np.ndarray | None = None
    # the document each token belongs to: an index per token, or a token file's first token of
    # each document (None: not known)
    documents: np.ndarray | DocumentStarts | None = None
    tokenizer: str = "byte"  # what made the ids: "byte" or a tokenizer directory
    notes: tuple[str, ...] = ()  # lines to say at start (a data.max_bytes cap)
    counted: int | None = None  # the tokens `targets` counts, where the sidecar records it

    def manifest(self) -> dict:
        """What a checkpoint records of the corpus."""
        return {"name": self.name, "tokens": int(len(self.tokens)), "sha256": self.fingerprint}


def fingerprint(tokens: np.ndarray, targets: np.ndarray | None = None) -> str:
    """sha256 hex of the token bytes (and of the target mask, where some tokens do not count)."""
    sha = hashlib.sha256(memoryview(np.ascontiguousarray(tokens)))
    if targets is not None:
        sha.update(memoryview(np.ascontiguousarray(targets, dtype=np.uint8)))
    return sha.hexdigest()


def cap_note(max_bytes: int, where: str, total: int | None) -> str:
    """The line that says what a `data.max_bytes` cap reads of `where` (`total` bytes, when
    known; None: a cap on text, counted as it is read)."""
    if total is None:
        return (
            f"data: data.max_bytes={max_bytes} reads at most the first {max_bytes} bytes of "
            f"text of {where}"
        )
    read = min(max_bytes, total)
    return (
        f"data: data.max_bytes={max_bytes} reads the first {read} of {total} bytes "
        f"({100 * read / max(total, 1):.1f}%) of {where}"
    )


def load_corpus(
    path: str | None,
    fmt: str = "auto",
    text_field: str = "text",
    max_bytes: int | None = None,
) -> Corpus:
    """Load a corpus; `max_bytes` caps its size (None: no cap).

    Raises `UserError` for a missing or unreadable file, an unknown format, a malformed JSONL line
    or a token file whose metadata does not match it. A corpus too short for one sample is not
    checked here: only the sampler knows the sequence length.
    """
    fmt = corpus_format(path, fmt)
    if fmt in ("hf", "chat"):  # `dsnd.data.sources` reads these, with their tokenizer
        raise UserError(f"{path}: {fmt} data is read with a tokenizer (dsnd.data.sources)")
    if max_bytes is not None and max_bytes < 1:
        raise UserError(f"corpus max_bytes must be at least 1, got {max_bytes}")
    documents, notes = None, ()
    if path is None:
        data, name = _stdlib_bytes(max_bytes), _stdlib_name()
        if max_bytes is not None:
            notes = (
                cap_note(
                    max_bytes,
                    f"the default corpus ({name}'s first {STDLIB_BYTES} bytes)",
                    STDLIB_BYTES,
                ),
            )
    elif fmt == "tokens":
        return token_corpus(path, max_bytes)
    elif fmt == "jsonl":
        parts = _read(
            path, lambda: text_parts(jsonl_values(path, text_field), text_field, max_bytes)
        )
        data, documents = join_documents(parts, max_bytes)
        name = path
        notes = () if max_bytes is None else (cap_note(max_bytes, path, None),)
    else:
        data, name = _read(path, lambda: _text_bytes(path, max_bytes)), path
        if max_bytes is not None:
            notes = (cap_note(max_bytes, path, os.path.getsize(path)),)
    tokens = np.frombuffer(data, dtype=np.uint8).copy()
    return Corpus(
        tokens=tokens,
        name=name,
        fingerprint=hashlib.sha256(data).hexdigest(),
        documents=documents,
        notes=notes,
    )


def token_corpus(path: str, max_bytes: int | None = None) -> Corpus:
    """Token file `path` as a corpus, memory-mapped with its document starts and loss mask where
    it has them; what is read at start does not grow with the file (`dsnd.data.token_extras`).
    A `max_bytes` cap keeps the first ``max_bytes // itemsize`` tokens."""
    tokens, meta = read_token_file(path, None)
    starts, mask = map_starts(path, meta), map_mask(path, meta)
    digest, notes, counted = meta["sha256"], (), recorded_count(path, meta)
    if max_bytes is not None:
        notes = (cap_note(max_bytes, path, tokens.nbytes),)
        keep = max_bytes // tokens.dtype.itemsize
        if keep < len(tokens):  # another corpus than the file's: its own fingerprint
            digest = hashlib.sha256(f"{digest}[:{keep}]".encode()).hexdigest()
            tokens, mask = tokens[:keep], None if mask is None else mask[:keep]
            counted = None  # the file's count is not the cut's
    return Corpus(
        tokens=tokens,
        name=path,
        fingerprint=digest,
        vocab_size=meta["vocab_size"],
        targets=mask,
        documents=None if starts is None else DocumentStarts(starts),
        tokenizer=str(meta.get("tokenizer") or "byte"),
        notes=notes,
        counted=counted,
    )


def _read(path: str, read: Callable[[], _T]) -> _T:
    try:
        return read()
    except OSError as e:  # unreadable (permissions, I/O error) after the checks passed
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e


def corpus_format(path: str | None, fmt: str, what: str = "data.path") -> str:
    """The format `path` is read as (`auto` resolved by extension: a directory, .parquet or
    .arrow is a Hugging Face dataset), after refusing an unknown format and a path that is
    missing, or not a regular file where a file is read; the stdlib corpus (no path) is bytes,
    read as text."""
    if fmt not in FORMATS:
        raise UserError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if path is None:
        if fmt in ("hf", "chat"):
            raise UserError(f"data.format={fmt} needs data.path (a dataset or JSONL file)")
        return "text"
    if fmt == "hf" or (fmt in ("auto", "chat") and is_dataset(path)):
        if not os.path.exists(path):
            raise UserError(f"{what}: not found: {path}")
        return fmt if fmt == "chat" else "hf"
    check_file(path, what)
    if fmt != "auto":
        return fmt
    return {".jsonl": "jsonl", ".json": "jsonl", ".bin": "tokens"}.get(
        Path(path).suffix.lower(), "text"
    )


def _text_bytes(path: str, max_bytes: int | None) -> bytes:
    """The raw bytes of a file (no decoding: the byte tokenizer takes any bytes)."""
    with open(path, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def join_documents(parts: list[bytes], max_bytes: int | None) -> tuple[bytes, np.ndarray]:
    """(the documents joined with a blank line and cut at `max_bytes`, the index of the document
    each byte belongs to: a separator belongs to the document before it, as an EOS would)."""
    data = _DOC_SEPARATOR.join(parts)
    sizes = [len(p) + len(_DOC_SEPARATOR) for p in parts]
    if sizes:
        sizes[-1] -= len(_DOC_SEPARATOR)
    documents = np.repeat(np.arange(len(parts), dtype=np.int32), sizes)
    if max_bytes is not None:
        data, documents = data[:max_bytes], documents[:max_bytes]
    return data, documents


def text_parts(
    values: Iterable[tuple[str, object]], text_field: str, max_bytes: int | None
) -> list[bytes]:
    """The UTF-8 bytes of each text value, until `max_bytes` (with separators) are collected."""
    parts: list[bytes] = []
    total = 0
    for where, text in values:
        encoded = _text_bytes_of(text, where, text_field)
        parts.append(encoded)
        total += len(encoded) + len(_DOC_SEPARATOR)
        if max_bytes is not None and total >= max_bytes:
            break
    return parts


def jsonl_values(path: str, field: str) -> Iterator[tuple[str, object]]:
    """("path:line", the record's `field`) of each non-blank JSONL line, or a UserError naming
    file:line when a line is not a JSON object holding `field`."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            record = _parse_record(raw, where, field)
            if not isinstance(record, dict):
                raise UserError(
                    f"{where}: expected a JSON object with field {field!r}, "
                    f"got {type(record).__name__}"
                )
            if field not in record:
                keys = ", ".join(sorted(map(str, record))) or "none"
                raise UserError(f"{where}: record has no field {field!r} (fields: {keys})")
            yield where, record[field]


def _text_bytes_of(text: object, where: str, text_field: str) -> bytes:
    """The UTF-8 bytes of one record's text, or a UserError naming `where` and the field."""
    if not isinstance(text, str):
        raise UserError(
            f"{where}: field {text_field!r} must be a string, got {type(text).__name__}"
        )
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to str no UTF-8 can hold
        raise UserError(
            f"{where}: field {text_field!r} holds a lone surrogate "
            f"{text[e.start]!r} at character {e.start}, which has no UTF-8 "
            "encoding"
        ) from None


def _parse_record(raw: bytes, where: str, text_field: str) -> object:
    """json.loads of one line; its failures (bad syntax, bad UTF-8, nesting deeper than the
    recursion limit, an integer longer than Python converts) as one line naming `where`."""
    expected = f"expected a JSON object with field {text_field!r}"
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:  # its own "line 1" would contradict `where`; keep column
        raise UserError(
            f"{where}: not valid JSON ({e.msg} at column {e.colno}); {expected}"
        ) from None
    except UnicodeDecodeError:
        raise UserError(f"{where}: not valid UTF-8; {expected}") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply to read; {expected}") from None
    except ValueError as e:  # the int digit limit: keep its first clause, not its sys.* advice
        reason = str(e).split(";")[0]
        raise UserError(f"{where}: JSON not readable ({reason}); {expected}") from None


def _stdlib_name() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"


@functools.cache
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    """Stdlib ``.py`` files in sorted relative-path order (``/``-separated, so stable per OS),
    listed once per process (a walk of the whole stdlib, repeated by every run a process
    trains otherwise)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = Path(dirpath, name)
                found.append((full.relative_to(root).as_posix(), full))
    found.sort()
    return tuple(full for _, full in found)


def _stdlib_bytes(max_bytes: int | None) -> bytes:
    """Concatenate stdlib sources with a newline between files until `STDLIB_BYTES` (or a smaller
    `max_bytes`) are reached."""
    max_bytes = STDLIB_BYTES if max_bytes is None else min(max_bytes, STDLIB_BYTES)
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for file in _stdlib_files(root):
        try:
            content = file.read_bytes()
        except OSError:  # an unreadable file is skipped the same way every time on a machine
            continue
        parts.append(content)
        total += len(content) + len(_FILE_SEPARATOR)
        if total >= max_bytes:
            break
    if not parts:
        raise UserError(
            f"data.path: no default corpus: no .py sources under {root}; "
            f"set data.path to a text or JSONL file"
        )
    return _FILE_SEPARATOR.join(parts)[:max_bytes]
