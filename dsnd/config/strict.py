"""Strict conversion of plain data (YAML, --set) into the schema dataclasses.

Every key must exist (else: did-you-mean), every value must have the field's type after a small,
predictable coercion. Errors name where the value came from: ``file.yaml:12`` or ``--set k=v``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any

from dsnd.config.schema import CHOICES
from dsnd.errors import UserError, did_you_mean, shown


def key_of(f: dataclasses.Field) -> str:
    """The key users write for field `f`: its name, or its metadata's "key" where the key is a
    Python keyword that cannot name a field (`checkpoint.async` is the field `async_`)."""
    return f.metadata.get("key", f.name)


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (the schema uses postponed annotations), by key."""
    hints = typing.get_type_hints(cls)
    return {key_of(f): hints[f.name] for f in dataclasses.fields(cls)}


def as_data(config: Any) -> dict[str, Any]:
    """A schema dataclass as plain data under the keys users write (`dataclasses.asdict` under
    the fields' names): what `build` reads back, as config.yaml and manifests record it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[key_of(f)] = as_data(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def schema_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of a dataclass tree, dotted, mapped to its type."""
    out: dict[str, Any] = {}
    for name, tp in field_types(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out.update(schema_keys(tp, key + "."))
        else:
            out[key] = tp
    return out


def _union_members(tp: Any) -> tuple:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return True, args[0]
    return False, tp


def _a(tp: type) -> str:
    name = {"str": "string", "dict": "mapping"}.get(tp.__name__, tp.__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


def _as_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:  # past float's range: as YAML reads 1e400, refused as not finite
        return math.inf if value > 0 else -math.inf


def coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """`value` as type `tp`, or a UserError naming `key` at `where`.

    Allowed conversions: int -> float, and number/bool -> str (so ``--set log.dir=2024`` is the
    directory "2024"). Nothing else is guessed: "3" for an int in YAML is an error.
    """
    members = [a for a in _union_members(tp) if a is not type(None)]
    if len(members) > 1:  # a union such as str | list: any member's type, as given
        if value is None and type(None) in _union_members(tp):
            return None
        if not isinstance(value, tuple(members)):
            names = " or ".join(_a(m) for m in members)
            raise UserError(
                f"{where}: {key} must be {names}, got {type(value).__name__} {shown(value)}"
            )
        return value
    optional, base = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}: {key} must be {_a(base)}, got null")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = _as_float(value)
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where}: {key} must be a finite number, got {value}")
    if base is str and isinstance(value, (int, float, bool)):
        return str(value)
    if base is int and isinstance(value, bool):
        raise UserError(f"{where}: {key} must be an int, got bool {shown(value)}")
    if not isinstance(value, base):
        raise UserError(
            f"{where}: {key} must be {_a(base)}, got {type(value).__name__} {shown(value)}"
        )
    if key in CHOICES and value not in CHOICES[key]:
        raise UserError(
            f"{where}: {key} must be one of {', '.join(CHOICES[key])}, got {shown(value)}"
            + did_you_mean(value, CHOICES[key])
        )
    return value


def build(cls: type, data: Any, where: dict[str, str], default_where: str, prefix: str = ""):
    """An instance of dataclass `cls` from `data`, checked key by key.

    `where` maps dotted keys to the place they were written (``file:line`` or ``--set ...``).
    """
    section = prefix.rstrip(".") or "top level"
    if not isinstance(data, dict):
        raise UserError(
            f"{where.get(prefix.rstrip('.'), default_where)}: {section} must be a mapping, "
            f"got {type(data).__name__}"
        )
    hints = field_types(cls)
    names = {key_of(f): f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        at = where.get(dotted, default_where)
        if key not in hints:
            hint = did_you_mean(str(key), hints)
            if not hint and not prefix:
                hint = " (DeepSpeed settings belong in the JSON named by 'deepspeed:')"
            raise UserError(f"{at}: unknown key '{dotted}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[names[key]] = build(tp, value, where, default_where, dotted + ".")
        else:
            kwargs[names[key]] = coerce(value, tp, dotted, at)
    return cls(**kwargs)
