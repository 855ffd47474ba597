"""Which global layers each pipeline stage holds: `parts` boundaries, as DeepSpeed computes them.

`partition(method, specs, num_stages)` returns `parts` (length num_stages + 1): stage s holds the
global layers parts[s] .. parts[s+1]-1, exactly like `PipelineModule.parts`. The named methods
call `partition_uniform` / `partition_balanced` (`dsnd.plan.boundaries`, DeepSpeed's written
out) on the same weights that `PipelineModule._partition_layers` feeds them, so a dsnd stage
holds the same layers as the DeepSpeed stage of the same rank, and per-layer checkpoint files
line up with DeepSpeed's:

- ``uniform``: layer counts as even as possible (earlier stages take the remainder);
- ``parameters``: trainable parameter counts balanced; a `TiedLayerSpec` counts its whole module
  at every position it occurs (DeepSpeed's `_count_layer_params` builds every `LayerSpec`,
  tied or not), so GPT-2's tied head weighs as much as its embedding although it owns nothing;
- ``type:<regex>``: the number of layers whose class name the regex `search`es (ignoring case)
  balanced; every layer counts 0 or 1, so a stage may hold no matching layer;
- an explicit list: boundaries ``[0, 3, 7]`` or per-stage layer lists ``[[0, 1, 2], [3, 4, 5, 6]]``.

Pure apart from `layer_param_counts`, which builds each layer on the meta device (shapes only,
no memory, no initialisation) — DeepSpeed builds them for real, one at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import torch
from torch import nn

from dsnd.errors import UserError, did_you_mean
from dsnd.model.layer_spec import LayerSpec
from dsnd.plan.boundaries import partition_balanced, partition_uniform

KEY = "parallel.partition"
PP_KEY = "parallel.pp"

# What PipelineModule accepts as a layer: a spec, a built module, or any callable.
Layer = Any
PartitionMethod = str | Sequence[int] | Sequence[Sequence[int]]


def layer_param_counts(specs: Sequence[Layer]) -> list[int]:
    """Trainable parameters per layer, counted as DeepSpeed's `_count_layer_params` counts them.

    Every `LayerSpec` — a `TiedLayerSpec` included, at each of its positions — is built and its
    `requires_grad` parameters summed; a built `nn.Module` counts its own; any other callable 0.
    Building happens under `torch.device("meta")`, so a 70B-shaped layer costs no memory.
    """
    counts = []
    for layer in specs:
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):
                module = layer.build()
            counts.append(_trainable(module))
        elif isinstance(layer, nn.Module):
            counts.append(_trainable(layer))
        else:
            counts.append(0)
    return counts


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_type_names(specs: Sequence[Layer]) -> list[str | None]:
    """The name ``type:<regex>`` is matched against, per layer, as DeepSpeed's `_find_layer_type`.

    A `LayerSpec` (tied or not) gives its module class's ``__name__`` — so GPT-2's tied head is
    ``GPT2Embedding``, not its `forward_fn` — a built module its class name, another callable its
    ``__name__``; None where there is none (DeepSpeed skips such layers: nothing matches them).
    """
    names: list[str | None] = []
    for layer in specs:
        if isinstance(layer, LayerSpec):
            names.append(layer.typename.__name__)
        elif isinstance(layer, nn.Module):
            names.append(type(layer).__name__)
        else:
            names.append(getattr(layer, "__name__", None))
    return names


def partition(
    method: PartitionMethod,
    specs: Sequence[Layer],
    num_stages: int,
    balance_profile: Callable[[int], list[int]] | None = None,
    stages_named: str = "",
) -> list[int]:
    """Stage boundaries `parts` (len num_stages + 1, 0 first, len(specs) last, strictly rising).

    `stages_named` is how messages name `num_stages` when it is not parallel.pp itself (the
    interleaved schedule's pp x virtual_stages chunks), so they quote the keys the user set.

    Named methods are matched ignoring case, as DeepSpeed lowercases them; ``profile`` (dsnd's
    own: DeepSpeed raises NotImplementedError for it) calls `balance_profile(num_stages)`, which
    balances measured layer costs (`dsnd.plan.profile`). Raises `UserError`
    for anything that would leave a stage without layers or differ from DeepSpeed's split.
    """
    n = len(specs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, Integral) or num_stages < 1:
        raise UserError(f"{PP_KEY}={num_stages!r} must be a positive number of pipeline stages")
    stages = stages_named or f"{PP_KEY}={num_stages}"
    if num_stages > n:
        raise UserError(
            f"{stages} is more than the model's {n} pipeline layers "
            f"({KEY}={_show(method)}); every stage needs at least one layer"
        )
    if isinstance(method, str):
        parts = _named(method, specs, num_stages, balance_profile)
    elif isinstance(method, Sequence):
        parts = _explicit(method, n, num_stages, stages)
    else:
        raise UserError(f"{KEY}={method!r} must be {_CHOICES}")
    for stage in range(num_stages):
        if parts[stage] >= parts[stage + 1]:  # a safety net: DeepSpeed's helpers never do this
            raise UserError(
                f"{KEY}={_show(method)} leaves pipeline stage {stage} of {stages} "
                f"without layers (boundaries {parts})"
            )
    return parts


def stage_layers(parts: Sequence[int], stage: int) -> list[int]:
    """The global layer indices stage `stage` holds under boundaries `parts`."""
    if not 0 <= stage < len(parts) - 1:
        raise ValueError(f"stage {stage} out of range for {len(parts) - 1} stages ({list(parts)})")
    return list(range(parts[stage], parts[stage + 1]))


_CHOICES = (
    "uniform, parameters, profile, type:<regex>, or a list of stage boundaries or of stage layers"
)


def _show(method: object) -> str:
    return f"'{method}'" if isinstance(method, str) else str(method)


def _named(
    method: str,
    specs: Sequence[Layer],
    num_stages: int,
    balance_profile: Callable[[int], list[int]] | None,
) -> list[int]:
    lowered = method.lower()  # PipelineModule._partition_layers does the same
    if lowered == "profile":
        if balance_profile is None:
            raise ValueError("partition 'profile' needs the measured layer costs")
        parts = balance_profile(num_stages)
    elif lowered == "uniform":
        parts = partition_uniform(num_items=len(specs), num_parts=num_stages)
    elif lowered == "parameters":
        parts = partition_balanced(weights=layer_param_counts(specs), num_parts=num_stages)
    elif lowered.startswith("type:"):
        parts = partition_balanced(weights=_type_weights(method, specs), num_parts=num_stages)
    else:
        raise UserError(f"{KEY}={_show(method)} is not a method{_suggest(method)}; use {_CHOICES}")
    return [int(p) for p in parts]


def _suggest(method: str) -> str:
    head, colon, rest = method.partition(":")
    if colon:  # "typ:Block" -> "type:Block": compare only what precedes the regex
        return f" (did you mean 'type:{rest}'?)" if did_you_mean(head.lower(), ["type"]) else ""
    return did_you_mean(method.lower(), ["uniform", "parameters", "profile"])


def _type_weights(method: str, specs: Sequence[Layer]) -> list[int]:
    """1 for each layer whose type name the regex matches, else 0 — DeepSpeed's binary weights.

    DeepSpeed compiles ``method.lower().split(':')[1]``. Two things in that would silently give a
    different split than the user wrote, so they are refused rather than mirrored: a ':' in the
    regex (everything after it is dropped) and an uppercase escape such as ``\\S`` (it becomes
    ``\\s``). Otherwise lowercasing is harmless, as the match ignores case anyway.
    """
    pattern = method[len("type:") :]
    if ":" in pattern:
        raise UserError(
            f"{KEY}={_show(method)}: the regex may not contain ':' (DeepSpeed's PipelineModule "
            f"would cut it at the ':' and match '{pattern.split(':')[0]}')"
        )
    upper = [e for e in re.findall(r"\\.", pattern) if e[1].isupper()]
    if upper:
        raise UserError(
            f"{KEY}={_show(method)}: DeepSpeed lowercases the method, so {upper[0]} would mean "
            f"{upper[0].lower()}; write the regex without uppercase escapes"
        )
    try:
        regex = re.compile(pattern.lower(), re.IGNORECASE)
    except re.error as err:
        raise UserError(f"{KEY}={_show(method)}: bad regex '{pattern}': {err}") from None
    names = layer_type_names(specs)
    weights = [int(name is not None and regex.search(name) is not None) for name in names]
    if not any(weights):
        types = ", ".join(dict.fromkeys(name for name in names if name is not None))
        raise UserError(f"{KEY}={_show(method)} matches none of the layer types: {types}")
    return weights


def _explicit(method: Sequence[Any], n: int, num_stages: int, stages: str) -> list[int]:
    items = list(method)
    if items and all(_is_int(x) for x in items):
        return _boundaries([int(x) for x in items], n, num_stages, stages)
    if items and all(isinstance(x, Sequence) and not isinstance(x, str) for x in items):
        return _stage_lists(items, n, num_stages, stages)
    raise UserError(f"{KEY}={_show(method)} must be {_CHOICES}")


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _boundaries(parts: list[int], n: int, num_stages: int, stages: str) -> list[int]:
    shown = f"{KEY}={parts}"
    if len(parts) != num_stages + 1:
        raise UserError(
            f"{shown} has {len(parts)} boundaries ({len(parts) - 1} stages) but {stages} "
            f"needs {num_stages + 1}"
        )
    if parts[0] != 0 or parts[-1] != n:
        raise UserError(f"{shown} must start at 0 and end at {n}, the number of layers")
    for stage in range(num_stages):
        if parts[stage] >= parts[stage + 1]:
            raise UserError(
                f"{shown} must rise strictly: stage {stage} would hold layers "
                f"{parts[stage]}..{parts[stage + 1] - 1}"
            )
    return parts


def _stage_lists(stages: list[Sequence[Any]], n: int, num_stages: int, named: str) -> list[int]:
    shown = f"{KEY}={[list(s) for s in stages]}"
    if len(stages) != num_stages:
        raise UserError(f"{shown} lists {len(stages)} stages but {named}")
    owner: dict[int, int] = {}
    for s, stage in enumerate(stages):
        if not stage or not all(_is_int(i) for i in stage):
            raise UserError(f"{shown}: stage {s} must be a non-empty list of layer indices")
        for i in stage:
            if not 0 <= i < n:
                raise UserError(f"{shown}: layer {i} does not exist (layers are 0..{n - 1})")
            if i in owner:
                where = f"twice in stage {s}" if owner[i] == s else f"in stages {owner[i]} and {s}"
                raise UserError(f"{shown}: layer {i} is {where}")
            owner[i] = s
    missing = [i for i in range(n) if i not in owner]
    if missing:
        raise UserError(f"{shown}: layers {missing} are in no stage")
    parts = [0]
    for s, stage in enumerate(stages):
        if list(stage) != list(range(parts[-1], parts[-1] + len(stage))):
            raise UserError(
                f"{shown}: stage {s} must be the contiguous run {parts[-1]}.."
                f"{parts[-1] + len(stage) - 1} (stages hold consecutive layers, in order)"
            )
        parts.append(parts[-1] + len(stage))
    return parts
