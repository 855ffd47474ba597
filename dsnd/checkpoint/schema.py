"""The shape of a checkpoint manifest: every key that loading, inspecting, exporting or verifying
reads, with the type it must have (pure; no files).

A manifest passes its own checksum before it gets here, so a wrong type is a hand edit or a
foreign writer, not disk damage; either way it must end as one line naming the key, never as a
KeyError or TypeError deep inside a load.

The trainer's numbers are checked by value too: a resume sets them as they are, so a NaN learning
rate would surface as a "divergence" steps later and a scheduler position of -1e9 as a silently
restarted warmup. `dsnd ckpt import` checks the DeepSpeed checkpoint's numbers with the same rules
(`value_problem`), naming the source file and key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from dsnd.checkpoint.files import MAX_STEP, STEP_DIGITS
from dsnd.checkpoint.safetensors_header import DTYPE_BYTES

Rule = tuple[str, Callable[[object], bool]]  # (what the value must be, the test)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return _number(v) and math.isfinite(v)


def _int_in(low: int, high: int) -> Callable[[object], bool]:
    return lambda v: _int(v) and low <= v <= high


def _list_of(test: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and all(test(x) for x in v)


COUNT: Rule = ("a non-negative integer", lambda v: _int(v) and v >= 0)
SIZE: Rule = ("a positive integer", lambda v: _int(v) and v >= 1)
TEXT: Rule = ("a string", lambda v: isinstance(v, str))
FLAG: Rule = ("true or false", lambda v: isinstance(v, bool))
NUMBER: Rule = ("a number", _number)
TABLE: Rule = ("an object", lambda v: isinstance(v, dict))
TABLE_OR_NULL: Rule = ("an object or null", lambda v: v is None or isinstance(v, dict))
COUNTS: Rule = ("a list of non-negative integers", _list_of(COUNT[1]))
TEXTS: Rule = ("a list of strings", _list_of(TEXT[1]))
STEP: Rule = (
    f"an integer in [0, {MAX_STEP}] (a step directory's name holds {STEP_DIGITS} digits)",
    _int_in(0, MAX_STEP),
)
LR: Rule = ("a finite number >= 0", lambda v: _finite(v) and v >= 0)
BETAS: Rule = (
    "null or two numbers in [0, 1)",
    lambda v: (
        v is None
        or (isinstance(v, list) and len(v) == 2 and all(_finite(b) and 0 <= b < 1 for b in v))
    ),
)
# an iteration DeepSpeed counts from -1 (none yet): a scheduler's position (one more per optimizer
# step) and the loss scaler's last overflow
POSITION: Rule = (f"an integer in [-1, {MAX_STEP}]", _int_in(-1, MAX_STEP))
LOSS_SCALE: Rule = ("a finite number > 0", lambda v: _finite(v) and v > 0)
_HEX64 = re.compile(r"[0-9a-f]{64}")
SHA256: Rule = ("64 lowercase hex digits", lambda v: bool(_HEX64.fullmatch(str(v))))
DTYPE: Rule = ("a safetensors dtype", lambda v: isinstance(v, str) and v in DTYPE_BYTES)

TOP: dict[str, Rule] = {
    "step": STEP,
    "consumed_samples": COUNT,
    "zero_stage": COUNT,
    "parts": COUNTS,
    "topology": TABLE,
    "model": TABLE,
    "versions": TABLE,
    "corpus": TABLE,
    "trainer": TABLE,
    "params": TABLE,
    "optim_keys": TEXTS,
}
NESTED: dict[str, dict[str, Rule]] = {
    "topology": {"pp": SIZE, "tp": SIZE, "dp": SIZE, "world_size": SIZE},
    "trainer": {
        "optimizer_step": COUNT,
        "lr": LR,
        "lr_scheduler": TABLE_OR_NULL,
        "betas": BETAS,
    },
    "corpus": {"name": TEXT, "tokens": COUNT, "sha256": TEXT},
}
NESTED_OPTIONAL: dict[str, dict[str, Rule]] = {
    # fp16's loss scaler (dsnd.engine.loss_scale.scaler_state); absent before fp16 was supported
    "trainer": {"loss_scaler": TABLE_OR_NULL},
    # context-parallel ranks (absent before context parallelism: 1)
    "topology": {"cp": SIZE},
}
# inside trainer: a DeepSpeed scheduler's state, and fp16's loss scaler (engine.loss_scale)
SCHEDULER: dict[str, Rule] = {"last_batch_iteration": POSITION}
SCALER: dict[str, Rule] = {
    "cur_scale": LOSS_SCALE,
    "cur_iter": COUNT,
    "last_overflow_iter": POSITION,
    "cur_hysteresis": SIZE,
    "skipped_steps": COUNT,
}
FILE_ENTRY: dict[str, Rule] = {"bytes": COUNT, "sha256": SHA256}
PARAM_ENTRY: dict[str, Rule] = {"file": TEXT, "shape": COUNTS}
DEFAULT_DTYPE = "F32"  # what every checkpoint without a "dtype" per parameter holds
LEGACY_MODEL: dict[str, Rule] = {
    "hidden_size": SIZE,
    "num_layers": SIZE,
    "num_heads": SIZE,
    "num_kv_heads": SIZE,
    "ffn_size": SIZE,
    "vocab_size": SIZE,
    "max_seq_len": SIZE,
    "tie_embeddings": FLAG,
}


def table_problems(
    where: str, table: object, rules: dict[str, Rule], optional: dict[str, Rule] | None = None
) -> list[str]:
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


def value_problem(value: object, rule: Rule) -> str | None:
    """The problem "is <value>, expected <what>" when `value` breaks `rule`, else None."""
    what, test = rule
    return None if test(value) else f"is {_show(value)}, expected {what}"


def _trainer_problems(trainer: dict) -> list[str]:
    """The scheduler's position and the loss scaler's numbers, when the trainer holds them."""
    out = []
    if isinstance(trainer.get("lr_scheduler"), dict):
        out += table_problems("trainer.lr_scheduler", trainer["lr_scheduler"], SCHEDULER)
    if isinstance(trainer.get("loss_scaler"), dict):  # fields a static scaler lacks may be absent
        out += table_problems("trainer.loss_scaler", trainer["loss_scaler"], {}, SCALER)
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MODEL_ENTRY = ("family", "config", "source", "directory")
# the shape keys a config must hold (spelled as the family's config class spells them)
REQUIRED_SHAPE = ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_position_embeddings")


def model_problems(model: dict) -> list[str]:
    """How manifest["model"] cannot rebuild the model (what export and generate build from)."""
    from dsnd.model.families import FAMILIES

    names = [f.name for f in FAMILIES]
    family: Rule = (f"one of {', '.join(names)}", lambda v: v in names)
    legacy = "config" not in model and any(k in model for k in LEGACY_MODEL)
    allowed = {"family", "init_std", *LEGACY_MODEL} if legacy else set(MODEL_ENTRY)
    unknown = sorted(set(model) - allowed)
    if unknown:
        return [f"model has '{unknown[0]}', which is not a dsnd model setting"]
    if legacy:  # written before configs were recorded: the shape only
        out = table_problems(
            "model", model, {"family": family, **LEGACY_MODEL}, {"init_std": NUMBER}
        )
    else:
        out = table_problems(
            "model", model, {"family": family, "config": TABLE}, {"source": TEXT, "directory": TEXT}
        )
    return out or _rebuild_problems(model, legacy)


def _rebuild_problems(model: dict, legacy: bool) -> list[str]:
    """What stops `from_manifest` (a config missing a shape key or holding one its class does
    not know, a value transformers refuses)."""
    from huggingface_hub.errors import StrictDataclassError

    from dsnd.errors import UserError
    from dsnd.model.checks import unknown_keys
    from dsnd.model.families import by_name
    from dsnd.model.source import SHAPE_KEYS, from_manifest

    if not legacy:
        config, cls = model["config"], by_name(model["family"]).config_class
        known = set(cls().to_dict())
        required = {next(n for n in SHAPE_KEYS[k] if n in known): SIZE for k in REQUIRED_SHAPE}
        out = table_problems("model.config", config, required)
        if out:
            return out
    try:
        spec = from_manifest(model)
    except UserError as e:
        return [f"model: {e}"]
    except (TypeError, ValueError, KeyError, ArithmeticError, StrictDataclassError) as e:
        return [f"model.config: transformers refuses it: {e.__cause__ or e}"]
    if not legacy:
        return [f"model.config: {p}" for p in unknown_keys(config, spec.config)][:1]
    return []


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
        out += table_problems(key, manifest[key], rules, NESTED_OPTIONAL.get(key))
    out += _trainer_problems(manifest["trainer"]) if isinstance(manifest["trainer"], dict) else []
    return out + model_problems(manifest["model"]) + _params_problems(manifest["params"])


def file_entry_problem(meta: object) -> str | None:
    """What is wrong with one manifest["files"] entry ({"bytes", "sha256"}), or None."""
    found = table_problems("its entry in the manifest's files", meta, FILE_ENTRY)
    return found[0] if found else None


def expected_dtype(meta: dict) -> str:
    """The dtype a parameter's tensor is stored in (checkpoints before "dtype" hold F32)."""
    return meta.get("dtype", DEFAULT_DTYPE)
