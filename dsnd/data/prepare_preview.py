"""`dsnd data prepare --preview N`: the first N documents exactly as they would be written
(the separators and end-of-text tokens included), decoded, with the tokens that do not count in
the loss between ``[[`` and ``]]``: plain text, readable without colour in a log or a diff.
Nothing is written; only the first documents are read (at most `PREVIEW_TOKENS` of each is
shown, and of a text file, which is one document, no more is read).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from dsnd.data.prepare import Spec, assemble, encoded_stream
from dsnd.errors import UserError

PREVIEW_TOKENS = 2048
OPEN, CLOSE = "[[", "]]"


@dataclass
class _Document:
    where: str
    ids: list[int] = field(default_factory=list)  # the shown ones
    mask: list[bool] = field(default_factory=list)
    tokens: int = 0
    counted: int = 0


def preview(spec: Spec, count: int) -> str:
    """The first `count` documents of `spec`, rendered (see the module's docstring)."""
    docs: list[_Document] = []
    for first, where, ids, mask in assemble(spec, encoded_stream(spec, 1)):
        if first:
            if len(docs) == count:
                break
            docs.append(_Document(where))
        doc = docs[-1]
        flags = np.ones(len(ids), bool) if mask is None else np.asarray(mask, bool)
        room = max(PREVIEW_TOKENS - len(doc.ids), 0)
        doc.ids += ids[:room].tolist()
        doc.mask += flags[:room].tolist()
        doc.tokens += len(ids)
        doc.counted += int(flags.sum())
        if spec.fmt == "text" and doc.tokens >= PREVIEW_TOKENS:
            break  # the file's one document: read no further
    if not any(d.tokens for d in docs):
        raise UserError(f"INPUT {spec.path}: no text to tokenize")
    return "".join(_render(spec, k, doc) for k, doc in enumerate(docs))


def _render(spec: Spec, k: int, doc: _Document) -> str:
    if spec.fmt == "text" and doc.tokens > len(doc.ids):
        size = f"the first {len(doc.ids)} tokens of the file"
    elif doc.tokens > len(doc.ids):
        size = f"{doc.tokens} tokens, the first {len(doc.ids)} shown"
    else:
        size = f"{doc.tokens} tokens"
    if doc.counted == doc.tokens:
        counted = "all counted"
    else:
        counted = f"{doc.counted} counted (the others in {OPEN}...{CLOSE})"
    text = []
    pairs = zip(doc.ids, doc.mask, strict=True)
    for counts, run in itertools.groupby(pairs, key=lambda pair: pair[1]):
        words = _decode(spec, [i for i, _ in run])
        text.append(words if counts else f"{OPEN}{words}{CLOSE}")
    body = "".join(text)
    end = "" if body.endswith("\n") else "\n"
    return f"=== document {k} ({doc.where}): {size}, {counted}\n{body}{end}"


def _decode(spec: Spec, ids: list[int]) -> str:
    if spec.tok is None:
        return bytes(ids).decode("utf-8", "replace")
    return spec.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
