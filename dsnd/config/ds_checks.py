"""Checks every DeepSpeed JSON section shares: its keys against the names DeepSpeed reads, a
``{"type", "params"}`` section, a parameter's type from its default (pure; one-line errors)."""

from __future__ import annotations

from typing import Any

from dsnd.errors import UserError, did_you_mean, raise_all


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_and_params(section: Any, name: str, path: str) -> tuple[str, dict[str, Any]] | None:
    """An ``{"type": ..., "params": {...}}`` section (optimizer, scheduler) as (type, params),
    None when absent, or a UserError."""
    if not isinstance(section, dict):  # absent, or the wrong type (reported by _check_types)
        return None
    check_section_keys(section, {"type", "params"}, {}, f"{path}: {name}")
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UserError(f"{path}: {name}.params must be an object, got {params!r}")
    return str(section.get("type", "")), params


def check_param_type(where: str, key: str, value: Any, like: Any) -> None:
    """Refuse `value` unless it has the type of `like` (a default: number, bool or string)."""
    if is_number(like) and not is_number(value):
        raise UserError(f"{where}.{key} must be a number, got {value!r}")
    if isinstance(like, (bool, str)) and not isinstance(value, type(like)):
        raise UserError(f"{where}.{key} must be {type(like).__name__}, got {value!r}")


def check_section_keys(section: dict, known: set[str], refused: dict[str, str], where: str) -> None:
    """Every unknown or refused key of a section DeepSpeed checks strictly, all at once."""
    raise_all(
        [
            f"{where}: '{key}' is refused: {refused[key]}"
            if key in refused
            else f"{where}: unknown key '{key}'" + did_you_mean(key, known | set(refused))
            for key in section
            if key in refused or key not in known
        ]
    )
