"""DeepSpeed parameter names -> dsnd's, for one model, checked name by name and shape by shape
(pure: names and shapes only).

A DeepSpeed checkpoint names parameters as the trained module did. Three namings are known:

- DeepSpeed's `PipelineModule`: `<i>.<name in layer>` for the layer at position i of its layer
  list (its file is `layer_<i>-model_*`), `tied_modules.<key>.<name>` for a tied module. Built
  from dsnd's own `layer_specs`, position i is dsnd's global layer i. A list of other layers
  (with parameter-free entries between, such as lambdas) maps in order: the k-th position
  holding parameters is dsnd's k-th layer holding parameters, a tied module is dsnd's tied
  embedding, and each pair must then hold the same names and shapes.
- dsnd's own `LayerStack` (`layers.<i>.<name>`, `tied_modules.embed.<name>`) in a plain engine.
- the family's `transformers` model (`model.layers.0.self_attn.q_proj.weight`, ...) in a plain
  engine, mapped by `dsnd.model.hf_weights.from_hf_name`.

Whatever the naming, the result must be exactly the model's parameters with their full shapes;
anything else is refused in one line naming the first difference.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dsnd.errors import UserError
from dsnd.model.count import full_shapes, meta_layers
from dsnd.model.hf_weights import from_hf_name
from dsnd.model.source import ModelSpec

Shapes = dict[str, tuple[int, ...]]
_PIPE = re.compile(r"(\d+)\.(.+)")
_TIED = re.compile(r"tied_modules\.([^.]+)\.(.+)")


def naming(names: list[str]) -> str:
    """'pipeline', 'dsnd' or 'transformers': how a DeepSpeed checkpoint names parameters."""
    if any(_PIPE.fullmatch(n) for n in names):
        return "pipeline"
    if all(n.startswith(("layers.", "tied_modules.")) for n in names):
        return "dsnd"
    return "transformers"


def _slots(shapes: Shapes, key_of) -> dict[object, Shapes]:
    """Names grouped by layer (`key_of(name)` -> (layer key, name in the layer))."""
    out: dict[object, Shapes] = {}
    for name, shape in shapes.items():
        key, rest = key_of(name)
        out.setdefault(key, {})[rest] = shape
    return out


def _pipeline_names(shapes: Shapes, model: ModelSpec, where: str) -> dict[str, str]:
    def ds_key(name: str):
        pipe, tied = _PIPE.fullmatch(name), _TIED.fullmatch(name)
        if pipe:
            return int(pipe.group(1)), pipe.group(2)
        if tied:
            return f"tied_modules.{tied.group(1)}", tied.group(2)
        raise UserError(
            f"{where}: parameter {name} is neither '<layer>.<name>' nor "
            "'tied_modules.<key>.<name>' (a PipelineModule's names)"
        )

    theirs = _slots(shapes, ds_key)
    ours = {
        prefix: {n: tuple(p.shape) for n, p in layer.named_parameters()}
        for _, prefix, layer in meta_layers(model)
        if layer is not None
    }
    our_tied = [p for p in ours if p.startswith("tied_modules.")]
    our_plain = [p for p in ours if not p.startswith("tied_modules.")]
    their_tied = sorted(k for k in theirs if isinstance(k, str))
    their_plain = sorted(k for k in theirs if isinstance(k, int))
    if len(their_tied) != len(our_tied):
        tied = ", ".join(their_tied) or "none"
        raise UserError(
            f"{where}: the checkpoint has {len(their_tied)} tied module(s) ({tied}) "
            f"but {model.source} has {len(our_tied)} "
            f"(tie_word_embeddings={model.tie_embeddings})"
        )
    if len(their_plain) != len(our_plain):
        raise UserError(
            f"{where}: the checkpoint's pipeline has {len(their_plain)} layers "
            f"holding parameters, {model.source} has {len(our_plain)} "
            f"(num_layers={model.num_layers})"
        )
    out = {}
    pairs = [*zip(their_tied, our_tied, strict=True), *zip(their_plain, our_plain, strict=True)]
    for their, our in pairs:
        label = f"layer_{their:02d}" if isinstance(their, int) else their
        _same_layer(theirs[their], ours[our], f"{where}: DeepSpeed's {label}", our, model)
        out |= {f"{their}.{rest}": our + rest for rest in theirs[their]}
    return out


def _same_layer(theirs: Shapes, ours: Shapes, where: str, our: str, model: ModelSpec) -> None:
    for rest in sorted(set(theirs) | set(ours)):
        if rest not in ours:
            raise UserError(f"{where} holds {rest}, which {model.source}'s {our}* has not")
        if rest not in theirs:
            raise UserError(
                f"{where} has no {rest} (shape {list(ours[rest])}), which "
                f"{model.source}'s {our}* has"
            )
        _check_shape(where, rest, theirs[rest], f"{our}{rest}", ours[rest], model)


def _check_shape(
    where: str,
    theirs: str,
    shape: Sequence[int],
    ours: str,
    want: tuple[int, ...],
    model: ModelSpec,
) -> None:
    """UserError when the checkpoint's `theirs` and the model's `ours` differ in shape."""
    if tuple(shape) != want:
        raise UserError(
            f"{where}: {theirs} has shape {list(shape)}, {model.source}'s {ours} has {list(want)}"
        )


def _hf_names(shapes: Shapes, model: ModelSpec, where: str) -> dict[str, str]:
    out = {}
    for name in shapes:
        try:
            ours = from_hf_name(name, model)
        except KeyError:
            raise UserError(
                f"{where}: parameter {name} is not one of a {model.family.name} "
                f"model's ({model.source})"
            ) from None
        if ours is not None:  # a tied head's second name, a buffer dsnd recomputes
            out[name] = ours
    return out


def dsnd_names(shapes: Shapes, model: ModelSpec, where: str) -> dict[str, str]:
    """{DeepSpeed name: dsnd name} for the trained parameters `shapes` (full shapes, by
    DeepSpeed name) of a checkpoint `where`; UserError naming the first name or shape that
    does not fit `model`."""
    kind = naming(list(shapes))
    if kind == "pipeline":
        mapping = _pipeline_names(shapes, model, where)
    elif kind == "dsnd":
        mapping = {n: n for n in shapes}
    else:
        mapping = _hf_names(shapes, model, where)
    want = full_shapes(model)
    seen: dict[str, str] = {}
    for theirs, ours in sorted(mapping.items()):
        if ours in seen:
            raise UserError(f"{where}: {seen[ours]} and {theirs} are both {ours}")
        seen[ours] = theirs
        if ours not in want:
            raise UserError(
                f"{where}: parameter {theirs} is not one of {model.source}'s ({model.describe()})"
            )
        _check_shape(where, theirs, shapes[theirs], ours, want[ours], model)
    missing = sorted(set(want) - set(seen))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{where}: the checkpoint has no {missing[0]} (shape "
            f"{list(want[missing[0]])}), which {model.source} has{more}"
        )
    return mapping


def layer_indices(model: ModelSpec) -> dict[str, int]:
    """{dsnd parameter name: its global layer} (a tied module's: its first layer's)."""
    return {
        prefix + name: index
        for index, prefix, layer in meta_layers(model)
        if layer is not None
        for name, _ in layer.named_parameters()
    }
