"""Which layers this rank's stage holds, and the module that holds them."""

from __future__ import annotations

from dsnd.config.resolve import Resolved
from dsnd.dist.groups import ProcessGroups
from dsnd.model import LayerStack, layer_specs
from dsnd.pipeline.partition import partition, stage_layers


def stage_parts(res: Resolved) -> list[int]:
    """Stage boundaries under `parallel.partition`: stage s holds global layers
    parts[s] .. parts[s + 1] - 1."""
    return partition(res.run.parallel.partition, layer_specs(res.dims), res.topology.pp)


def check_stages(res: Resolved) -> None:
    """Raise UserError now (before any rank starts) if `parallel.partition` cannot split the
    model into `parallel.pp` non-empty stages."""
    stage_parts(res)


def build_stage(res: Resolved, groups: ProcessGroups) -> LayerStack:
    """This rank's layers, initialised exactly as in the full model (seed, global index, name)."""
    return LayerStack(
        layer_specs(res.dims),
        res.run.train.seed,
        layer_indices=stage_layers(stage_parts(res), groups.coord.pp),
        activation_checkpoint_interval=res.run.parallel.activation_checkpoint_interval,
    )
