"""Load a training corpus as one flat array of byte tokens.

Three sources, all read into memory at once (corpora here are small: the cap defaults to 4 MB):

* no path: the Python standard library's own ``.py`` sources — real, varied text present on every
  machine that runs dsnd, so a first run and every test need no download;
* a plain text file: its raw bytes;
* a JSONL file: one JSON object per line, the ``text_field`` of each joined with a blank line;
* a pre-tokenized ``.bin`` file (`dsnd.data.token_file`), memory-mapped, not loaded.

The fingerprint (sha256 of the token bytes) goes into checkpoint manifests so a resume can tell
that it is reading the same data it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsnd.data.token_file import check_file, read_token_file
from dsnd.errors import UserError

FORMATS = ("auto", "text", "jsonl", "tokens")

# Directories of the stdlib tree that are not "the standard library's own sources": third-party
# packages, the (huge, repetitive) test suites, and tooling that would dominate the first MBs.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_DOC_SEPARATOR = b"\n\n"  # between JSONL records
_FILE_SEPARATOR = b"\n"  # between stdlib source files


@dataclass
class Corpus:
    """A loaded corpus.

    tokens: 1-D token ids (uint8 for the byte tokenizer).
    name: where it came from (the path, or ``python3.X-stdlib``), for logs and manifests.
    fingerprint: sha256 hex of ``tokens.tobytes()``, to detect a changed corpus on resume.
    """

    tokens: np.ndarray
    name: str
    fingerprint: str
    vocab_size: int | None = None  # a pre-tokenized file's vocabulary (None: bytes, 256)


def load_corpus(
    path: str | None,
    fmt: str = "auto",
    text_field: str = "text",
    max_bytes: int | None = 4_000_000,
) -> Corpus:
    """Load a corpus; `max_bytes` caps its size (None: no cap).

    Raises `UserError` for a missing or unreadable file, an unknown format, a malformed JSONL line
    or a token file whose metadata does not match it. A corpus too short for one sample is not
    checked here: only the sampler knows the sequence length.
    """
    fmt = corpus_format(path, fmt)
    if max_bytes is not None and max_bytes < 1:
        raise UserError(f"corpus max_bytes must be at least 1, got {max_bytes}")
    if path is None:
        data, name = _stdlib_bytes(max_bytes), _stdlib_name()
    elif fmt == "tokens":  # max_bytes caps the file's bytes, as for text
        tokens, meta = read_token_file(path, None)
        if max_bytes is not None:
            tokens = tokens[: max_bytes // tokens.dtype.itemsize]
        fingerprint = hashlib.sha256(memoryview(np.ascontiguousarray(tokens))).hexdigest()
        return Corpus(tokens=tokens, name=path, fingerprint=fingerprint,
                      vocab_size=meta["vocab_size"])  # fmt: skip
    else:
        read = _jsonl_bytes if fmt == "jsonl" else _text_bytes
        try:
            data = read(path, text_field, max_bytes)
        except OSError as e:  # unreadable (permissions, I/O error) after the checks passed
            raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
        name = path
    tokens = np.frombuffer(data, dtype=np.uint8).copy()
    return Corpus(tokens=tokens, name=name, fingerprint=hashlib.sha256(data).hexdigest())


def corpus_format(path: str | None, fmt: str, what: str = "data.path") -> str:
    """The format `path` is read as (`auto` resolved by extension), after refusing an unknown
    format and a path that is missing or not a regular file; the stdlib corpus (no path) is
    bytes, read as text."""
    if fmt not in FORMATS:
        raise UserError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if path is None:
        return "text"
    check_file(path, what)
    if fmt != "auto":
        return fmt
    return {".jsonl": "jsonl", ".json": "jsonl", ".bin": "tokens"}.get(
        Path(path).suffix.lower(), "text"
    )


def _text_bytes(path: str, _text_field: str, max_bytes: int | None) -> bytes:
    """The raw bytes of a file (no decoding: the byte tokenizer takes any bytes)."""
    with open(path, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def _jsonl_bytes(path: str, text_field: str, max_bytes: int | None) -> bytes:
    """Join the `text_field` of each JSONL record; stop reading once `max_bytes` are collected.

    Hugging Face's ``Dataset.to_json`` writes JSON Lines under a ``.json`` name, which is why
    ``auto`` reads ``.json`` this way too.
    """
    parts: list[bytes] = []
    total = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            encoded = _record_bytes(raw, path, lineno, text_field)
            parts.append(encoded)
            total += len(encoded) + len(_DOC_SEPARATOR)
            if max_bytes is not None and total >= max_bytes:
                break
    data = _DOC_SEPARATOR.join(parts)
    return data if max_bytes is None else data[:max_bytes]


def _record_bytes(raw: bytes, path: str, lineno: int, text_field: str) -> bytes:
    """The UTF-8 text of one JSONL line, or a UserError naming file:line and the field."""
    where = f"{path}:{lineno}"
    record = _parse_record(raw, where, text_field)
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: expected a JSON object with field {text_field!r}, "
            f"got {type(record).__name__}"
        )
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise UserError(f"{where}: record has no field {text_field!r} (fields: {keys})")
    text = record[text_field]
    if not isinstance(text, str):
        raise UserError(
            f"{where}: field {text_field!r} must be a string, got {type(text).__name__}"
        )
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to str no UTF-8 can hold
        raise UserError(f"{where}: field {text_field!r} holds a lone surrogate "
                        f"{text[e.start]!r} at character {e.start}, which has no UTF-8 "
                        "encoding") from None  # fmt: skip


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


def _stdlib_files(root: Path) -> list[Path]:
    """Stdlib ``.py`` files in sorted relative-path order (``/``-separated, so stable per OS)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = Path(dirpath, name)
                found.append((full.relative_to(root).as_posix(), full))
    found.sort()
    return [full for _, full in found]


def _stdlib_bytes(max_bytes: int | None) -> bytes:
    """Concatenate stdlib sources with a newline between files until `max_bytes` are reached."""
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
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts:
        raise UserError(
            f"data.path: no default corpus: no .py sources under {root}; "
            f"set data.path to a text or JSONL file"
        )
    data = _FILE_SEPARATOR.join(parts)
    return data if max_bytes is None else data[:max_bytes]
