"""Load a run: the YAML, its DeepSpeed JSON, and the ``--set`` overrides, all checked strictly.

``--set KEY=VALUE``: VALUE is parsed as JSON, else taken as a string, then coerced to the field's
type. ``--set ds.a.b=v`` sets one key of the DeepSpeed JSON, creating parents (``null`` deletes;
an object value replaces the key's whole object). A ``deepspeed:`` path is relative to the YAML
that names it, or to the current directory when given by ``--set``; a YAML without the key
takes dsnd's packaged ``zero0.json`` (the default's), wherever the YAML lies.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from dsnd.config import deepspeed_json, json_lines, strict
from dsnd.config.ds_auto import fill_auto
from dsnd.config.packaged import default_config_path, packaged_json
from dsnd.config.schema import RunConfig
from dsnd.config.yaml_lines import load_yaml
from dsnd.errors import UserError, did_you_mean


@dataclass
class LoadedConfig:
    """A run config as the user wrote it (DeepSpeed batch keys not yet derived)."""

    run: RunConfig
    ds: dict[str, Any]
    yaml_path: str
    ds_path: str
    sets: list[str] = field(default_factory=list)
    ds_file: dict[str, Any] | None = None  # the JSON file as read (None: the same as `ds`)
    ds_sets: list[deepspeed_json.DsSet] = field(default_factory=list)  # merged into `ds`


def set_label(item: str) -> str:
    """``--set ITEM`` for messages, shortened when the item is too long to read in one line."""
    return f"--set {item if len(item) <= 100 else item[:97] + '...'}"


def parse_set(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, value parsed as JSON, else the raw string).

    JSON that dsnd refuses (a duplicate key, nesting past MAX_DEPTH) is an error, not a string.
    NaN and Infinity parse (``log.dir=NaN`` is a directory); number fields refuse them.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"{set_label(item)}: expected KEY=VALUE")
    try:
        value = json_lines.loads(raw, finite=False)
    except json.JSONDecodeError:
        value = raw
    except json_lines.JSONProblem as e:
        raise UserError(f"{set_label(item)}: {e.message}") from None
    return key.strip(), value


def _is_str_field(tp: Any) -> bool:
    return tp is str or (
        typing.get_origin(tp) in (types.UnionType, typing.Union) and str in typing.get_args(tp)
    )


def _assign(data: dict[str, Any], dotted: str, value: Any, label: str) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"{label}: '{part}' is not a section")
        node = child
    node[last] = value


def _ds_key(key: str, label: str) -> str:
    """The DeepSpeed key of ``ds.KEY``, checked: present, and no deeper than a JSON may be."""
    dotted = key[3:]
    if not dotted:
        raise UserError(f"{label}: expected ds.KEY=VALUE")
    if dotted.count(".") >= json_lines.MAX_DEPTH:
        raise UserError(f"{label}: key nested deeper than {json_lines.MAX_DEPTH} levels")
    return dotted


def load(config_path: str | None, sets: list[str] | None = None) -> LoadedConfig:
    """Read and check a run config; raises UserError on any problem."""
    sets = list(sets or [])
    yaml_path = config_path or default_config_path()
    data, lines = load_yaml(yaml_path)
    where = {key: f"{yaml_path}:{line}" for key, line in lines.items()}

    known = strict.schema_keys(RunConfig)
    ds_sets: list[deepspeed_json.DsSet] = []
    ds_from_cli = False
    for item in sets:
        key, value = parse_set(item)
        label = set_label(item)
        if key.startswith("ds."):
            ds_sets.append((_ds_key(key, label), value, label))
            continue
        # a mapping field (model.overrides) takes its keys one by one too: KEY.SUBKEY=VALUE
        mapping = next((k for k in known if known[k] is dict and key.startswith(k + ".")), None)
        if key not in known and mapping is None:
            raise UserError(f"{label}: unknown key '{key}'" + did_you_mean(key, known))
        if mapping is None and _is_str_field(known[key]) and isinstance(value, (int, float, bool)):
            value = item.partition("=")[2].strip()  # log.dir=1e3 is "1e3", not "1000.0"
        _assign(data, key, value, label)
        where[mapping or key] = label
        ds_from_cli |= key == "deepspeed"

    run = strict.build(RunConfig, data, where, yaml_path)
    base = os.getcwd() if ds_from_cli else os.path.dirname(os.path.abspath(yaml_path))
    # a YAML without `deepspeed:` means the packaged default JSON, not a zero0.json beside it
    written = ds_from_cli or "deepspeed" in data
    ds_path = os.path.normpath(os.path.join(base, run.deepspeed)) if written else packaged_json(0)
    ds_file = deepspeed_json.load_json(ds_path)
    # checked as it will run: "auto" filled (the numbers do not matter yet: resolve fills them
    # again for the model and world)
    ds, _ = deepspeed_json.check_blamed(
        lambda d, where: deepspeed_json.check_keys(fill_auto(d, 1, 1)[0], where),
        ds_file,
        ds_path,
        ds_sets,
    )
    return LoadedConfig(
        run=run,
        ds=ds,
        yaml_path=yaml_path,
        ds_path=ds_path,
        sets=sets,
        ds_file=ds_file,
        ds_sets=ds_sets,
    )
