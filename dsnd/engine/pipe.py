"""dsnd's layer specs as DeepSpeed's pipeline takes them.

dsnd describes its model with its own `LayerSpec` / `TiedLayerSpec` (`dsnd.model.layer_spec`,
same names and attributes as DeepSpeed's), so only this package imports DeepSpeed. Where
DeepSpeed's own `PipelineModule` is built (the benchmark against its pipeline engine, tests that
compare stage boundaries) the specs are converted here; a built module or plain callable passes
through as DeepSpeed accepts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def deepspeed_specs(layers: Sequence[Any]) -> list[Any]:
    """Each dsnd spec (an object with `typename`, `module_args`, `module_kwargs`, and `key`,
    `forward_fn`, `tied_weight_attr` when tied) as DeepSpeed's `LayerSpec` / `TiedLayerSpec`."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    out = []
    for layer in layers:
        if not hasattr(layer, "typename"):
            out.append(layer)
        elif hasattr(layer, "key"):
            out.append(
                TiedLayerSpec(
                    layer.key,
                    layer.typename,
                    *layer.module_args,
                    forward_fn=layer.forward_fn,
                    tied_weight_attr=list(layer.tied_weight_attr),
                    **layer.module_kwargs,
                )
            )
        else:
            out.append(LayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs))
    return out


def pipeline_module(layers: Sequence[Any], **kwargs: Any) -> Any:
    """DeepSpeed's `PipelineModule` over `layers` (dsnd specs converted), `kwargs` as its own."""
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=deepspeed_specs(layers), **kwargs)


def pipeline_engine(module: Any, model_parameters: Any, config: dict[str, Any]) -> Any:
    """DeepSpeed's `PipelineEngine` for a `pipeline_module` (the process group is up already)."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=model_parameters, config=config, dist_init_required=False
    )
    return engine
