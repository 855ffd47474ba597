"""Which file and key of a DeepSpeed checkpoint a bad value of `dsnd ckpt import` came from.

DeepSpeed's universal-checkpoint conversion joins each parameter's fp32 master, Adam moments and
step count out of the ZeRO optimizer files (`*_optim_states.pt`) into files of a temporary
directory beside OUT; a NaN there, or a step count that is not an integer, is an optimizer file's.
So a refusal names that file and the key in it, the nesting as `torch.load` shows it (string
keys joined by '.', list indices and integer keys in brackets), found by reading the optimizer
files once more: only when something is wrong, so an import that is fine reads them once.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Callable, Iterator

import torch

from dsnd.engine import ds_checkpoint
from dsnd.errors import UserError, shown

STEP_RULE = "a non-negative integer (an int, or a one-element tensor holding one)"


def step_count(value: object) -> int | None:
    """Adam's step count as DeepSpeed and torch keep it (a Python int, or a one-element tensor:
    torch's Adam counts in a float tensor), else None. A string "3" is not read as 3."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_complex():
        number = value.item()
        if isinstance(number, bool) or not math.isfinite(number) or number < 0:
            return None
        return int(number) if float(number).is_integer() else None
    return None


def walk(value: object, key: str = "") -> Iterator[tuple[str, object]]:
    """(key, leaf) for every leaf of nested dicts, lists and tuples."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                yield from walk(v, f"{key}[{k}]")
            else:
                yield from walk(v, f"{key}.{k}" if key else k)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from walk(v, f"{key}[{i}]")
    else:
        yield key, value


def non_finite(_key: str, value: object) -> bool:
    return (
        torch.is_tensor(value)
        and value.is_floating_point()
        and not bool(torch.isfinite(value.float()).all())
    )


def bad_step(key: str, value: object) -> bool:
    return re.split(r"[.\]]", key)[-1] == "step" and step_count(value) is None


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def find(tag_dir: str, test: Callable[[str, object], bool]) -> tuple[str, str, object] | None:
    """(file, key, value) of the first leaf of the tag's optimizer files `test` holds for."""
    for path in sorted(glob.glob(os.path.join(tag_dir, "*_optim_states.pt")), key=_natural):
        try:
            state = ds_checkpoint.load(path)
        except Exception:  # noqa: BLE001 - read once already by the conversion; blame elsewhere
            continue
        for key, value in walk(state):
            if test(key, value):
                return path, key, value
    return None


def check_finite(value: torch.Tensor, tag_dir: str, name: str, key: str) -> None:
    """UserError naming the optimizer file and key that hold the NaN or infinity of parameter
    `name`'s `key` (fp32, exp_avg, ...) after the conversion, unless `value` is finite."""
    if bool(torch.isfinite(value).all()):
        return
    where = f"DeepSpeed's conversion carried them into parameter {name}'s {key}"
    found = find(tag_dir, non_finite)
    if found is None:
        raise UserError(
            f"{tag_dir}: parameter {name}'s {key} holds NaN or infinite values "
            "after DeepSpeed's conversion; dsnd continues only a finite state"
        )
    raise UserError(
        f"{found[0]}: '{found[1]}' holds NaN or infinite values ({where}); dsnd "
        "continues only a finite state"
    )


def checked_step(value: object, tag_dir: str) -> int:
    """Adam's step count `value` as an int; UserError naming the optimizer file and key it came
    from when it is not an integer (a string, a fraction, a bool, several numbers)."""
    count = step_count(value)
    if count is not None:
        return count
    found = find(tag_dir, bad_step)
    if found is None:
        raise UserError(
            f"{tag_dir}: the optimizer's step count is {shown(value)}, expected {STEP_RULE}"
        )
    raise UserError(f"{found[0]}: '{found[1]}' is {shown(found[2])}, expected {STEP_RULE}")
