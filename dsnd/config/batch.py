"""Batch-size arithmetic, the one place it is done.

DeepSpeed's rule: ``train_batch_size = micro_batch * grad_accum * dp``. Three keys given must
agree, two derive the third, one follows DeepSpeed (gas = 1). Unlike DeepSpeed, an inexact
division is an error naming every number, not a silently floored value or a bare assert.
"""

from __future__ import annotations

from typing import NamedTuple

from dsnd.errors import UserError

TRAIN, MICRO, GAS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


MAX_BATCH = 2**31 - 1
"""The largest batch number accepted: sequence counts index int32 tensors in torch's kernels,
and a larger one (DeepSpeed takes any Python int, ``1e300`` too) could never be trained."""


class Batch(NamedTuple):
    train: int
    micro: int
    gas: int


def _exact(numerator: int, denominator: int, what: str, where: str, numbers: str) -> int:
    if numerator % denominator or numerator < denominator:
        raise UserError(f"{where}: cannot derive {what}: {numbers} does not divide exactly")
    return numerator // denominator


def resolve_batch(
    train: int | None, micro: int | None, gas: int | None, dp: int, where: str
) -> Batch:
    """The three batch numbers for `dp` data-parallel ranks, or a UserError with all of them."""
    for key, value in ((TRAIN, train), (MICRO, micro), (GAS, gas)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH
        ):
            raise UserError(f"{where}: {key} must be an integer in 1..{MAX_BATCH}, got {value!r}")
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * dp:
            raise UserError(
                f"{where}: {TRAIN}={train} != {MICRO}={micro} * {GAS}={gas} * dp={dp} "
                f"(= {micro * gas * dp})"
            )
        return Batch(train, micro, gas)
    if train is not None and micro is not None:
        numbers = f"{TRAIN}={train} / ({MICRO}={micro} * dp={dp})"
        return Batch(train, micro, _exact(train, micro * dp, GAS, where, numbers))
    if train is not None and gas is not None:
        numbers = f"{TRAIN}={train} / ({GAS}={gas} * dp={dp})"
        return Batch(train, _exact(train, gas * dp, MICRO, where, numbers), gas)
    if micro is not None and gas is not None:
        return Batch(micro * gas * dp, micro, gas)
    if train is not None:
        numbers = f"{TRAIN}={train} / dp={dp}"
        return Batch(train, _exact(train, dp, MICRO, where, numbers), 1)
    if micro is not None:
        return Batch(micro * dp, micro, 1)
    raise UserError(f"{where}: set {TRAIN} or {MICRO} (or both)")
