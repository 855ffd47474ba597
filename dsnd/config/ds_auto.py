"""Fill in what a user's DeepSpeed JSON leaves to the caller, as the Hugging Face integration
does, so that the JSONs users already have run unchanged.

- ``"auto"`` values: the Hugging Face Trainer fills them from its own arguments; dsnd fills the
  optimizer's and scheduler's from the run's learning-rate keys and recipes
  (`dsnd.config.lr_schedule`: train.lr, train.warmup_steps, train.lr_decay, train.min_lr,
  ``total_num_steps`` = ``train.steps``), and the rest from the model (ZeRO bucket sizes from the
  hidden size, with Hugging Face's formulas). Batch keys set to ``"auto"`` are derived by the
  batch rule (the packaged micro-batch when nothing else sets it, and at least 2 x pp
  micro-batches per step in a pipeline); precision ``"auto"`` is fp32, as the Hugging Face
  Trainer's is unless its ``--bf16`` / ``--fp16`` flag asks (dsnd's flag is the JSON's
  ``"enabled": true``).
- DeepSpeed's legacy forms, as it still reads them: ``"zero_optimization": true`` (stage 1),
  ``cpu_offload`` / ``cpu_offload_param`` (the CPU offload sections).
- a JSON with neither ``optimizer`` nor ``scheduler`` (Megatron's and Hugging Face's leave them
  to the calling code): the run's AdamW and schedule; an optimizer without a scheduler: its lr,
  constant, as DeepSpeed runs it (`dsnd.config.lr_schedule`); a missing ``gradient_clipping``:
  DeepSpeed's own default (1.0 in 0.19.8: it clips when the JSON says nothing), written out.

Every decision is returned as a note (logged at start, shown by ``dsnd ds-config check``), and
the filled JSON is what the run saves beside itself, so it stays the one home of these settings.
Written by hand: the Hugging Face version (`transformers.integrations.HfTrainerDeepSpeedConfig`)
reads a `TrainingArguments` object and the model, neither of which a dsnd run has.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

from dsnd.config.batch import GAS, MICRO, TRAIN
from dsnd.config.lr_schedule import fill_lr
from dsnd.config.packaged import packaged_json
from dsnd.config.schema import TrainConfig

AUTO = "auto"


@cache
def packaged() -> dict[str, Any]:
    """The packaged ZeRO-1 JSON (its micro-batch is the "auto" one)."""
    with open(packaged_json(1), encoding="utf-8") as f:
        return json.load(f)


def fill_auto(
    ds: dict[str, Any],
    hidden: int,
    steps: int,
    pp: int = 1,
    dp: int = 1,
    train: TrainConfig | None = None,
    fine_tune: bool = False,
    where: str = "the DeepSpeed JSON",
) -> tuple[dict[str, Any], list[str]]:
    """(a copy of `ds` with the above filled in, one note per decision), for a model of hidden
    size `hidden` trained `steps` steps on `pp` pipeline stages x `dp` data-parallel ranks, with
    the run's learning-rate keys `train` (`fine_tune`: model.init_from is set); errors name
    `where`."""
    ds = copy.deepcopy(ds)
    notes: list[str] = []
    _batch(ds, pp, dp, notes)
    _legacy_zero(ds, notes)
    fill_lr(ds, train or TrainConfig(), fine_tune, steps, where, notes)
    if ds.get("gradient_clipping") == AUTO:
        ds["gradient_clipping"] = 1.0
        notes.append("gradient_clipping: 'auto' -> 1.0")
    elif "gradient_clipping" not in ds:
        _default_clipping(ds, notes)
    _precision(ds, notes)
    _zero_buckets(ds.get("zero_optimization"), hidden, notes)
    _zero_defaults(ds.get("zero_optimization"), notes)
    return ds, notes


def _batch(ds: dict[str, Any], pp: int, dp: int, notes: list[str]) -> None:
    """Batch keys set to "auto" are left to the batch rule, with the micro-batch of dsnd's
    packaged JSON when no number sets it; a pipeline's gradient accumulation steps (unset, or
    "auto") become 2 x pp where the numbers allow, so that 1F1B has every stage busy for most
    of the step (with gas = 1, a pp-stage step is (pp - 1) / pp bubble)."""
    autos = [key for key in (TRAIN, MICRO, GAS) if ds.get(key) == AUTO]
    if not autos:
        return
    for key in autos:
        del ds[key]
    chosen = []
    if MICRO not in ds and TRAIN not in ds:
        ds[MICRO] = packaged()[MICRO]
        chosen.append(f"{MICRO} {ds[MICRO]} (dsnd's packaged JSON)")
    gas = 2 * pp
    free = GAS not in ds and not (TRAIN in ds and MICRO in ds)
    if pp > 1 and free and (TRAIN not in ds or ds[TRAIN] % (gas * dp) == 0):
        ds[GAS] = gas
        chosen.append(
            f"{GAS} {gas} (2 x parallel.pp={pp}: micro-batches enough to keep "
            "every pipeline stage busy; one would leave the step mostly bubble)"
        )
    elif pp > 1 and free:
        chosen.append(
            f"{GAS} from {TRAIN}={ds[TRAIN]}, which {gas} x dp={dp} does not divide: "
            f"fewer than 2 x parallel.pp={pp} micro-batches, mostly bubble"
        )
    rest = ", then the batch rule" if chosen else ""
    notes.append(f"{', '.join(autos)}: 'auto' -> {'; '.join(chosen) or 'the batch rule'}{rest}")


LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""ZeRO's deprecated offload switches, which DeepSpeed 0.19.8 still reads, and their new keys."""


def _legacy_zero(ds: dict[str, Any], notes: list[str]) -> None:
    """DeepSpeed's deprecated forms, translated as DeepSpeed reads them."""
    if isinstance(ds.get("zero_optimization"), bool):
        stage = int(ds["zero_optimization"])
        ds["zero_optimization"] = {"stage": stage}
        notes.append(
            f"zero_optimization: {str(bool(stage)).lower()} (the legacy form, as "
            f"DeepSpeed reads it) -> stage {stage}"
        )
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for old, new in LEGACY_OFFLOAD.items():
        if old in zero:
            on = zero.pop(old)
            if on and new not in zero:
                zero[new] = {
                    "device": "cpu",
                    "pin_memory": bool(zero.get("cpu_offload_use_pin_memory", False)),
                }
            notes.append(
                f"zero_optimization.{old}: {str(bool(on)).lower()} (deprecated, as "
                f"DeepSpeed reads it) -> {new}: {zero.get(new, 'none')}"
            )
    zero.pop("cpu_offload_use_pin_memory", None)


def _default_clipping(ds: dict[str, Any], notes: list[str]) -> None:
    """No `gradient_clipping`: DeepSpeed clips at its own default (1.0 in 0.19.8, where older
    versions did not clip), written into the JSON so that the run, its reference and the note
    say what DeepSpeed does."""
    from dsnd.engine.deepspeed_api import default_gradient_clipping

    ds["gradient_clipping"] = default_gradient_clipping()
    notes.append(
        f"gradient_clipping: none in the JSON -> DeepSpeed's default "
        f"{ds['gradient_clipping']:g} (clipping by the global norm; set 0 to turn it "
        "off)"
    )


def _precision(ds: dict[str, Any], notes: list[str]) -> None:
    """Precision "auto" is off, as the Hugging Face Trainer fills it from its --bf16 / --fp16
    flags (off unless given): a JSON turns bf16 on only by saying so."""
    autos = [
        name
        for name in ("bf16", "bfloat16", "fp16")
        if isinstance(ds.get(name), dict) and ds[name].get("enabled") == AUTO
    ]
    for name in autos:
        ds[name]["enabled"] = False
    if autos:
        notes.append(
            f"{', '.join(autos)}: 'auto' -> fp32, as the Hugging Face Trainer does "
            'without --bf16 / --fp16 ("enabled": true, or --set '
            f"ds.{autos[0]}.enabled=true, asks for it)"
        )


HF_BUCKETS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
"""Hugging Face's "auto" ZeRO bucket sizes from the model's hidden size."""


def _zero_buckets(zero: Any, hidden: int, notes: list[str]) -> None:
    if not isinstance(zero, dict):
        return
    for key, formula in HF_BUCKETS.items():
        if zero.get(key) == AUTO:
            zero[key] = formula(hidden)
            notes.append(f"zero_optimization.{key}: 'auto' -> {zero[key]} (hidden size {hidden})")


def _zero_defaults(zero: Any, notes: list[str]) -> None:
    """Any other ZeRO "auto": DeepSpeed's own default, which DeepSpeed would use silently."""
    if not isinstance(zero, dict):
        return
    from dsnd.engine.deepspeed_api import zero_config_model

    fields = zero_config_model().model_fields
    by_name = {f.alias or name: f for name, f in fields.items()} | dict(fields)
    for key, value in list(zero.items()):
        default = by_name[key].default if key in by_name else None
        if value == AUTO and default is not None:
            # DeepSpeed's pp_int prints with commas: store a plain number
            zero[key] = int(default) if isinstance(default, int) else default
            notes.append(
                f"zero_optimization.{key}: 'auto' -> {zero[key]} (DeepSpeed's "
                "default, which DeepSpeed itself would use)"
            )


def remaining_autos(value: Any, path: str = "") -> list[str]:
    """Dotted keys still set to "auto" (nothing above knows how to fill them)."""
    if value == AUTO:
        return [path]
    if isinstance(value, dict):
        return [
            k
            for key, v in value.items()
            for k in remaining_autos(v, f"{path}.{key}" if path else str(key))
        ]
    return []
