"""YAML with the line of every key, so errors can say ``run.yaml:12``; and never more of it than
a run config can be (`check_shape`), so a hostile file is one error line, not a MemoryError."""

from __future__ import annotations

from typing import Any

import yaml

from dsnd.config.json_lines import MAX_DEPTH
from dsnd.errors import UserError

MAX_VALUES = 10_000
"""Most values (keys, scalars, collections; aliases counted as what they stand for) accepted in
a run config; the packaged one has about a hundred."""


class _Loader(yaml.SafeLoader):
    """SafeLoader, but an integer too long for int() is a YAML error with its line, not a bare
    ValueError from the constructor."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {len(node.value)} digits is out of range",
                node.start_mark,
            ) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _refuse(path: str, event: yaml.Event, what: str) -> UserError:
    return UserError(f"{path}:{event.start_mark.line + 1}: {what}")


def _add(path: str, event: yaml.Event, open_: list[list], values: int, depth: int) -> None:
    """Count a value of `values` values and `depth` levels into the innermost open collection."""
    if len(open_) + depth > MAX_DEPTH:
        raise _refuse(path, event, f"nested deeper than {MAX_DEPTH} levels")
    if open_:
        parent = open_[-1]
        parent[1] += values
        parent[2] = max(parent[2], depth)
        if parent[1] > MAX_VALUES:
            raise _refuse(
                path,
                event,
                f"aliases expand to more than {MAX_VALUES} values (a run "
                "config has about a hundred)",
            )


def check_shape(text: str, path: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH and documents of more than MAX_VALUES values, from
    the parser's events, before anything recursive walks the document.

    PyYAML shares an aliased node rather than copying it, so ~800 bytes of nested aliases
    (``b: &b [*a, *a, ...]`` ten times over) are billions of values to every walk that follows
    them (the key-line table, the dataclasses, a saved config.yaml), and an alias inside its own
    anchor is an endless one. Sizes are counted per anchor, so the count itself stays cheap.
    """
    named: dict[str, tuple[int, int]] = {}  # anchor -> (values, depth) of what it names
    open_: list[list] = []  # [anchor, values, depth] of each collection not yet closed
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            if any(o[0] == event.anchor for o in open_):
                raise _refuse(path, event, f"alias *{event.anchor} is inside its own anchor")
            _add(path, event, open_, *named.get(event.anchor, (1, 0)))
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor:
                named[event.anchor] = (1, 0)
            _add(path, event, open_, 1, 0)
        elif isinstance(event, yaml.CollectionStartEvent):
            _add(path, event, open_, 0, 1)  # the depth check, before it is entered
            open_.append([event.anchor, 1, 0])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, values, depth = open_.pop()
            if anchor:
                named[anchor] = (values, depth + 1)
            _add(path, event, open_, values, depth + 1)


def _key_lines(node: yaml.Node, prefix: str, out: dict[str, int], path: str) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if dotted in out:  # PyYAML would silently keep the last one
                raise UserError(
                    f"{path}:{line}: duplicate key '{dotted}' (first on line {out[dotted]})"
                )
            out[dotted] = line
            _key_lines(value_node, dotted + ".", out, path)


def _parse(text: str, path: str) -> tuple[Any, yaml.Node | None]:
    """The data and the node tree of `text`, checked by `check_shape` first."""
    check_shape(text, path)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        return (loader.construct_document(node) if node is not None else None), node
    finally:
        loader.dispose()


def load_yaml(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The mapping in `path` and a dotted-key -> line table."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read run config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: cannot read run config: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    try:
        data, node = _parse(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{path}{line}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a run config must be a YAML mapping, got {type(data).__name__}")
    lines: dict[str, int] = {}
    if node is not None:
        _key_lines(node, "", lines, path)
    return data, lines
