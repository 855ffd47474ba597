"""JSON as dsnd accepts it: no duplicate keys, finite numbers, at most MAX_DEPTH levels deep.

Python's json keeps the last of two equal keys without a word, reads NaN, Infinity and 1e400 as
numbers DeepSpeed would train with, and recurses once per nesting level (``[[[[...`` 100k deep
is a RecursionError, not an error message). Its ``object_pairs_hook`` sees no positions, so
the object parser is hand-written on the standard library's pure-Python scanner
(``json.scanner.py_make_scanner`` asks its context for ``parse_object``): that is the one place
that knows where each key starts, and so can name both lines of a duplicate key.
"""

from __future__ import annotations

import itertools
import json
import math
from json.decoder import WHITESPACE, JSONArray, scanstring
from json.scanner import py_make_scanner
from typing import Any

MAX_DEPTH = 32
"""Deepest nesting accepted in a run config or DeepSpeed JSON (real ones use four levels)."""


class JSONProblem(Exception):
    """Valid JSON that dsnd refuses; `pos` is where in the text (for a line number), `first`
    where a duplicated key was first."""

    def __init__(self, message: str, pos: int, first: int | None = None) -> None:
        super().__init__(message)
        self.message, self.pos, self.first = message, pos, first

    def in_file(self, text: str) -> str:
        """``LINE: message`` with the first key's line too, for `text` read from a file."""
        first = f" (first on line {line_of(text, self.first)})" if self.first is not None else ""
        return f"{line_of(text, self.pos)}: {self.message}{first}"


class _Refused:
    """A number the scanner read that dsnd refuses; raised with its key once that is known."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a finite number")


def _float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"{text} is not a finite number")


def _int(text: str) -> int | _Refused:
    try:
        return int(text)
    except ValueError:  # longer than int() converts (sys.get_int_max_str_digits)
        return _Refused(f"an integer of {len(text)} digits is out of range")


def dotted(path: list[str | int]) -> str:
    """``a.b[0].c`` for the keys and indexes in `path`."""
    return "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(path)
    )


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _skip_space(s: str, end: int) -> int:
    return WHITESPACE.match(s, end).end()


class _Decoder(json.JSONDecoder):
    """A decoder that keeps the path to the value it is reading, for messages."""

    def __init__(self, finite: bool) -> None:
        if finite:
            super().__init__(parse_float=_float, parse_int=_int, parse_constant=_constant)
        else:
            super().__init__(parse_int=_int)
        self.path: list[str | int] = []
        self.parse_object = self._object
        self.parse_array = self._array
        self.scan_once = py_make_scanner(self)

    def _enter(self, pos: int) -> None:
        if len(self.path) >= MAX_DEPTH:
            raise JSONProblem(f"nested deeper than {MAX_DEPTH} levels", pos)

    def _value(self, s: str, end: int, key: str | int, scan_once) -> tuple[Any, int]:
        self.path.append(key)
        try:
            value, after = scan_once(s, end)
        except StopIteration as e:
            raise json.JSONDecodeError("Expecting value", s, e.value) from None
        if isinstance(value, _Refused):
            raise JSONProblem(f"{dotted(self.path)}: {value.reason}", end)
        self.path.pop()
        return value, after

    def _object(self, s_and_end, strict, scan_once, *hooks_and_memo) -> tuple[dict, int]:
        s, end = s_and_end
        self._enter(end - 1)
        out: dict[str, Any] = {}
        starts: dict[str, int] = {}
        end = _skip_space(s, end)
        if s[end : end + 1] == "}":
            return out, end + 1
        while True:
            if s[end : end + 1] != '"':
                raise json.JSONDecodeError(
                    "Expecting property name enclosed in double quotes", s, end
                )
            key, after = scanstring(s, end + 1, strict)
            if key in starts:
                raise JSONProblem(f"duplicate key '{dotted([*self.path, key])}'", end, starts[key])
            starts[key] = end
            end = _skip_space(s, after)
            if s[end : end + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", s, end)
            out[key], end = self._value(s, _skip_space(s, end + 1), key, scan_once)
            end = _skip_space(s, end)
            if s[end : end + 1] == "}":
                return out, end + 1
            if s[end : end + 1] != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", s, end)
            end = _skip_space(s, end + 1)

    def _array(self, s_and_end, scan_once) -> tuple[list, int]:
        self._enter(s_and_end[1] - 1)
        index = itertools.count()
        return JSONArray(s_and_end, lambda s, end: self._value(s, end, next(index), scan_once))


def loads(text: str, finite: bool = True) -> Any:
    """The value in `text`; json.JSONDecodeError when it is not JSON, JSONProblem when dsnd
    refuses it (a duplicate key; nesting past MAX_DEPTH; NaN, Infinity or an overflowing float
    unless `finite` is False; an integer too long to convert)."""
    value = _Decoder(finite).decode(text)
    if isinstance(value, _Refused):
        raise JSONProblem(value.reason, _skip_space(text, 0))
    return value
