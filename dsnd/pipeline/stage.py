"""Which layers this rank's stage holds, and the module that holds them."""

from __future__ import annotations

from dsnd.config.resolve import Resolved
from dsnd.dist.groups import ProcessGroups
from dsnd.model import LayerStack, layer_specs
from dsnd.pipeline.partition import partition, stage_layers


def stage_layer_indices(res: Resolved, stage: int) -> list[int]:
    """Global layer indices of pipeline stage `stage` under `parallel.partition`."""
    specs = layer_specs(res.dims)
    parts = partition(res.run.parallel.partition, specs, res.topology.pp)
    return stage_layers(parts, stage)


def stage_parts(res: Resolved) -> list[int]:
    """Stage boundaries: stage s holds global layers parts[s] .. parts[s + 1] - 1."""
    return partition(res.run.parallel.partition, layer_specs(res.dims), res.topology.pp)


def check_stages(res: Resolved) -> None:
    """Raise UserError now (before any rank starts) if `parallel.partition` cannot split the
    model into `parallel.pp` non-empty stages."""
    partition(res.run.parallel.partition, layer_specs(res.dims), res.topology.pp)


def build_stage(res: Resolved, groups: ProcessGroups) -> LayerStack:
    """This rank's layers, initialised exactly as in the full model (seed, global index, name)."""
    specs = layer_specs(res.dims)
    indices = stage_layer_indices(res, groups.coord.pp)
    return LayerStack(
        specs,
        res.run.train.seed,
        layer_indices=indices,
        activation_checkpoint_interval=res.run.parallel.activation_checkpoint_interval,
    )
