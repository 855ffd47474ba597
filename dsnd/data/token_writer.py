"""Writing token files (`dsnd.data.token_file` reads them) a batch at a time, in bounded memory.

    OUT.bin        token ids, little-endian uint16 (uint32 when the vocabulary needs it)
    OUT.bin.docs   with "documents": N in the sidecar: N little-endian int64 start offsets, the
                   index of each document's first token (the first 0, strictly increasing: a
                   document without tokens is not recorded)
    OUT.bin.mask   with "targets": true: one uint8 per token, 1 where it counts in the loss
    OUT.bin.json   the sidecar: dtype, vocab_size, tokens, tokenizer, source, sha256 (of
                   OUT.bin's bytes), eot (the id written after each document, or null), and
                   documents / targets as above

The sidecar is written last, to a temporary name renamed into place, and an old one is removed
before anything else is written: a prepare killed half way leaves token files without a sidecar,
which `read_token_file` refuses, never a pair that looks whole but is not.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import BinaryIO

import numpy as np

from dsnd.data.token_file import meta_path
from dsnd.errors import UserError

DOCS_SUFFIX = ".docs"
MASK_SUFFIX = ".mask"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned little-endian dtype that holds ids below `vocab_size`."""
    return np.dtype("<u2" if vocab_size <= 2**16 else "<u4")


class TokenWriter:
    """Appends documents' tokens to `path` (and their starts and masks to its companions), then
    `finish` writes the sidecar; `abort` removes whatever was written."""

    def __init__(self, path: str, dtype: np.dtype, targets: bool, documents: bool = True) -> None:
        self.path, self.dtype = path, np.dtype(dtype).newbyteorder("<")
        self.tokens = self.documents = self.counted = 0
        self.max_id = -1  # the largest id written
        self.sha = hashlib.sha256()
        self._starting = False  # a document began and has no token yet
        self._files: dict[str, BinaryIO] = {}
        _make_parent(path)
        stale = [meta_path(path), path + DOCS_SUFFIX, path + MASK_SUFFIX]
        wanted = [path] + [
            path + s for s, on in ((DOCS_SUFFIX, documents), (MASK_SUFFIX, targets)) if on
        ]
        try:
            for old in stale:
                if os.path.lexists(old) and not os.path.isdir(old):
                    os.unlink(old)
            for name in wanted:
                self._files[name] = open(name, "wb")  # noqa: SIM115 - closed by finish/abort
        except OSError as e:  # an output that is a directory, read-only, under a file
            self.abort()
            raise _write_error(path, e) from e

    def begin_document(self) -> None:
        """The next token starts a document."""
        self._starting = True

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append `ids` (and whether each counts, where the file has a mask) to the document."""
        if not len(ids):
            return
        top = int(ids.max())
        if top >= 2 ** (8 * self.dtype.itemsize):
            raise UserError(
                f"{self.path}: token id {top} does not fit the file's {self.dtype.name} ids"
            )
        self.max_id = max(self.max_id, top)
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self.sha.update(data)
        self._write(self.path, data)
        docs = self.path + DOCS_SUFFIX
        if self._starting and docs in self._files:
            self._write(docs, np.array([self.tokens], dtype="<i8").tobytes())
            self.documents += 1
        self._starting = False
        masked = self.path + MASK_SUFFIX
        if masked in self._files:
            flags = np.ones(len(ids), np.uint8) if mask is None else np.asarray(mask, np.uint8)
            self.counted += int(flags.sum())
            self._write(masked, flags.tobytes())
        else:
            self.counted += len(ids)
        self.tokens += len(ids)

    def _write(self, name: str, data: bytes) -> None:
        try:
            self._files[name].write(data)
        except OSError as e:  # disk full, an I/O error
            raise _write_error(name, e) from e

    def finish(self, vocab_size: int, tokenizer: str, source: str, eot: int | None) -> dict:
        """Close the files and write the sidecar (atomically); returns its metadata."""
        meta: dict = {
            "dtype": self.dtype.name,
            "vocab_size": vocab_size,
            "tokens": self.tokens,
            "tokenizer": tokenizer,
            "source": source,
            "sha256": self.sha.hexdigest(),
            "eot": eot,
        }
        if self.path + DOCS_SUFFIX in self._files:
            meta["documents"] = self.documents
        if self.path + MASK_SUFFIX in self._files:
            meta["targets"] = True
            meta["counted"] = self.counted  # so a run says its share without reading the mask
        where = meta_path(self.path)
        temporary = f"{where}.tmp{os.getpid()}"
        try:
            for f in self._files.values():
                f.close()
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, where)
        except OSError as e:
            _remove(temporary)
            raise _write_error(where, e) from e
        return meta

    def abort(self) -> None:
        """Close and remove every file written (a failed prepare leaves no partial output)."""
        for name, f in self._files.items():
            f.close()
            _remove(name)
        self._files.clear()


def write_tokens(
    path: str,
    ids: np.ndarray,
    vocab_size: int,
    tokenizer: str,
    source: str,
    starts: np.ndarray | None = None,
    targets: np.ndarray | None = None,
    eot: int | None = None,
) -> dict:
    """Write an in-memory token file at once: `ids`, the document `starts` (token offsets) and
    the `targets` mask where given; returns the sidecar's metadata."""
    ids = np.asarray(ids)
    writer = TokenWriter(path, token_dtype(vocab_size), targets is not None, starts is not None)
    try:
        bounds = [0, len(ids)] if starts is None else [*np.asarray(starts).tolist(), len(ids)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            writer.begin_document()
            writer.add(ids[a:b], None if targets is None else np.asarray(targets)[a:b])
        return writer.finish(vocab_size, tokenizer, source, eot)
    except BaseException:
        writer.abort()
        raise


def write_token_file(
    path: str, ids: np.ndarray, vocab_size: int, tokenizer: str, source: str
) -> dict:
    """Write `ids` and the sidecar, no documents or mask; returns the metadata."""
    return write_tokens(path, ids, vocab_size, tokenizer, source)


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):  # makedirs would say "File exists"
        raise UserError(f"{path}: cannot write the token file ({parent} is not a directory)")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise _write_error(path, e) from e


def _write_error(path: str, e: OSError) -> UserError:
    return UserError(f"{e.filename or path}: cannot write the token file ({e.strerror or e})")


def _remove(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass
