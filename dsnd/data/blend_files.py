"""`data.blend` read and checked: a list of {path, weight} naming token files of one tokenizer,
each error one line naming the entry (``data.blend[1].weight``) and the value, before any process
group starts. The sampling itself is `dsnd.data.blend`'s."""

from __future__ import annotations

import math

from dsnd.config.schema import DataConfig
from dsnd.data.blend import PERIOD, BlendedCorpus, normalised, quotas
from dsnd.data.corpus import corpus_format, token_corpus
from dsnd.errors import UserError, did_you_mean

_KEYS = ("path", "weight")


def blend_entries(data: DataConfig) -> list[tuple[str, float]]:
    """(path, weight) of each file of `data.blend`, checked as written (not the files)."""
    blend = data.blend
    if data.path is not None:
        raise UserError(
            f"data.blend and data.path={data.path} are exclusive: a blend names each "
            "of its files; set one of them"
        )
    if not isinstance(blend, list) or not blend:
        raise UserError(f"data.blend must be a non-empty list of {{path, weight}}, got {blend!r}")
    if data.format not in ("auto", "tokens"):
        raise UserError(
            f"data.blend: blends are of token files (dsnd data prepare), "
            f"not data.format={data.format}"
        )
    entries = [_entry(item, f"data.blend[{i}]") for i, item in enumerate(blend)]
    weights = [w for _, w in entries]
    for i, slots in enumerate(quotas(weights).tolist()):
        if slots < 1:
            share = normalised(weights)[i]
            raise UserError(
                f"data.blend[{i}].weight={weights[i]}: {share:.3g} of the blend, "
                f"less than one sample in {PERIOD} (the schedule's resolution); "
                "give it a larger weight or leave it out"
            )
    return entries


def _entry(item: object, where: str) -> tuple[str, float]:
    if not isinstance(item, dict):
        raise UserError(
            f"{where} must be a mapping {{path, weight}}, got {type(item).__name__} {item!r}"
        )
    for key in item:
        if key not in _KEYS:
            hint = did_you_mean(str(key), _KEYS) or " (expected path and weight)"
            raise UserError(f"{where}: unknown key {key!r}{hint}")
    missing = [k for k in _KEYS if k not in item]
    if missing:
        raise UserError(
            f"{where}: missing {' and '.join(missing)} (each file of a blend is {{path, weight}})"
        )
    path, weight = item["path"], item["weight"]
    if not isinstance(path, str) or not path:
        raise UserError(f"{where}.path must be a token file's path, got {path!r}")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or weight <= 0
    ):
        raise UserError(f"{where}.weight must be a number > 0, got {weight!r}")
    return path, float(weight)


def load_blend(data: DataConfig) -> BlendedCorpus:
    """The token files of `data.blend`, memory-mapped (`token_corpus`, capped by
    data.max_bytes each), refused unless every one has the first one's tokenizer and
    vocabulary."""
    entries = blend_entries(data)
    parts = []
    for i, (path, _) in enumerate(entries):
        where = f"data.blend[{i}].path"
        fmt = corpus_format(path, data.format, what=where)
        if fmt != "tokens":
            raise UserError(
                f"{where}={path}: not a token file (a .bin written by 'dsnd data "
                "prepare', or set data.format: tokens)"
            )
        parts.append(token_corpus(path, data.max_bytes))
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (part.tokenizer, part.vocab_size) != (first.tokenizer, first.vocab_size):
            raise UserError(
                f"data.blend[{i}].path={part.name}: tokenized with {part.tokenizer} "
                f"(vocabulary {part.vocab_size}), data.blend[0].path={first.name} "
                f"with {first.tokenizer} (vocabulary {first.vocab_size}); the files "
                "of a blend must share one tokenizer"
            )
    return BlendedCorpus(tuple(parts), normalised([w for _, w in entries]))
