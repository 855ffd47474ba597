"""The model a plan is for: a dsnd model (preset, transformers directory or config.json), its
shape and its split into stages as `parallel.partition: parameters` splits it."""

from __future__ import annotations

from dsnd.layout_search.search import Split
from dsnd.layout_search.shape import ModelShape, from_model
from dsnd.model.source import ModelSpec, load_model
from dsnd.plan.partition import partition

PARTITION = "parameters"  # the run config's default, and what `--out` writes


def stage_split(model: ModelSpec) -> Split:
    """(pp, chunks per stage) -> each stage's layers: DeepSpeed's balanced split of parameter
    counts into pp x chunks parts; stage s holds chunks s, s + pp, ... ."""
    from dsnd.model.stack import layer_specs

    specs = layer_specs(model)

    def split(pp: int, virtual: int) -> list[list[int]]:
        n = pp * virtual
        parts = partition(PARTITION, specs, n)
        chunks = [list(range(parts[c], parts[c + 1])) for c in range(n)]
        return [sum((chunks[c] for c in range(s, n, pp)), []) for s in range(pp)]

    return split


def load(source: str) -> tuple[ModelSpec, ModelShape, Split]:
    model = load_model(source, "--model")
    return model, from_model(model, model.describe()), stage_split(model)
