"""The shape of a checkpoint manifest: every key that loading, inspecting, exporting or verifying
reads, with the type it must have (pure; no files).

A manifest passes its own checksum before it gets here, so a wrong type is a hand edit or a
foreign writer, not disk damage; either way it must end as one line naming the key, never as a
KeyError or TypeError deep inside a load.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from dsnd.checkpoint.safetensors_header import DTYPE_BYTES

Rule = tuple[str, Callable[[object], bool]]  # (what the value must be, the test)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _list_of(test: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(test(x) for x in v)


COUNT: Rule = ("a non-negative integer", lambda v: _int(v) and v >= 0)
SIZE: Rule = ("a positive integer", lambda v: _int(v) and v >= 1)
TEXT: Rule = ("a string", lambda v: isinstance(v, str))
FLAG: Rule = ("true or false", lambda v: isinstance(v, bool))
NUMBER: Rule = ("a number", _number)
TABLE: Rule = ("an object", lambda v: isinstance(v, dict))
TABLE_OR_NULL: Rule = ("an object or null", lambda v: v is None or isinstance(v, dict))
NUMBERS_OR_NULL: Rule = ("a list of numbers or null", lambda v: v is None or _list_of(_number)(v))
COUNTS: Rule = ("a list of non-negative integers", _list_of(COUNT[1]))
TEXTS: Rule = ("a list of strings", _list_of(TEXT[1]))
_HEX64 = re.compile(r"[0-9a-f]{64}")
SHA256: Rule = ("64 lowercase hex digits", lambda v: bool(_HEX64.fullmatch(str(v))))
DTYPE: Rule = ("a safetensors dtype", lambda v: isinstance(v, str) and v in DTYPE_BYTES)

TOP: dict[str, Rule] = {
    "step": COUNT, "consumed_samples": COUNT, "zero_stage": COUNT, "parts": COUNTS,
    "topology": TABLE, "model": TABLE, "versions": TABLE, "corpus": TABLE, "trainer": TABLE,
    "params": TABLE, "optim_keys": TEXTS,
}  # fmt: skip
NESTED: dict[str, dict[str, Rule]] = {
    "topology": {"pp": SIZE, "tp": SIZE, "dp": SIZE, "world_size": SIZE},
    "trainer": {
        "optimizer_step": COUNT,
        "lr": NUMBER,
        "lr_scheduler": TABLE_OR_NULL,
        "betas": NUMBERS_OR_NULL,
    },  # fmt: skip
    "corpus": {"name": TEXT, "tokens": COUNT, "sha256": TEXT},
}
FILE_ENTRY: dict[str, Rule] = {"bytes": COUNT, "sha256": SHA256}
PARAM_ENTRY: dict[str, Rule] = {"file": TEXT, "shape": COUNTS}
DEFAULT_DTYPE = "F32"  # what every checkpoint without a "dtype" per parameter holds
LEGACY_MODEL: dict[str, Rule] = {
    "hidden_size": SIZE, "num_layers": SIZE, "num_heads": SIZE, "num_kv_heads": SIZE,
    "ffn_size": SIZE, "vocab_size": SIZE, "max_seq_len": SIZE, "tie_embeddings": FLAG,
}  # fmt: skip


def table_problems(where: str, table: object, rules: dict[str, Rule],
                   optional: dict[str, Rule] | None = None) -> list[str]:  # fmt: skip
    """Each way `table` (named `where`) breaks `rules` (required keys) or `optional` (keys that
    may be absent)."""
    if not isinstance(table, dict):
        return [f"{where} is {_show(table)}, expected an object"]
    out = []
    for key, (what, test) in {**rules, **(optional or {})}.items():
        if key not in table:
            if key in rules:
                out.append(f"{where} has no '{key}'")
        elif not test(table[key]):
            out.append(f"'{key}' of {where} is {_show(table[key])}, expected {what}")
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _model_problems(model: dict) -> list[str]:
    """How manifest["model"] cannot rebuild the model (what export and generate build from)."""
    from dsnd.model.families import FAMILIES

    names = [f.name for f in FAMILIES]
    family: Rule = (f"one of {', '.join(names)}", lambda v: v in names)
    if "config" not in model:  # written before configs were recorded: the shape only
        return table_problems("model", model, {"family": family, **LEGACY_MODEL},
                              {"init_std": NUMBER})  # fmt: skip
    return table_problems("model", model, {"family": family, "config": TABLE},
                          {"source": TEXT, "directory": TEXT})  # fmt: skip


def _params_problems(params: dict) -> list[str]:
    """The first bad params entry (one is enough to name; they are all written alike)."""
    if not params:
        return ["params lists no parameters"]
    for name, meta in sorted(params.items()):
        found = table_problems(f"params['{name}']", meta, PARAM_ENTRY, {"dtype": DTYPE})
        if found:
            return found[:1]
    return []


def manifest_problems(manifest: dict) -> list[str]:
    """Every key of a manifest (beyond format and files) that loading, inspecting or exporting
    reads and that is missing or mistyped, one line each."""
    out = table_problems("the manifest", manifest, TOP)
    if out:
        return out
    for key, rules in NESTED.items():
        out += table_problems(key, manifest[key], rules)
    return out + _model_problems(manifest["model"]) + _params_problems(manifest["params"])


def file_entry_problem(meta: object) -> str | None:
    """What is wrong with one manifest["files"] entry ({"bytes", "sha256"}), or None."""
    found = table_problems("its entry in the manifest's files", meta, FILE_ENTRY)
    return found[0] if found else None


def expected_dtype(meta: dict) -> str:
    """The dtype a parameter's tensor is stored in (checkpoints before "dtype" hold F32)."""
    return meta.get("dtype", DEFAULT_DTYPE)
