"""YAML with the line of every key, so errors can say ``run.yaml:12``."""

from __future__ import annotations

from typing import Any

import yaml

from dsnd.errors import UserError


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


def load_yaml(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The mapping in `path` and a dotted-key -> line table."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read run config: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text)
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
