"""A layer of the model before it is built: its class and constructor arguments.

dsnd's own pair of the classes DeepSpeed's pipeline takes (`deepspeed.pipe.LayerSpec` and
`TiedLayerSpec`), with their names and attributes, so the model, the partition and the Plan are
plain Python that imports without DeepSpeed. `dsnd.engine.pipe` turns them into DeepSpeed's
where DeepSpeed's own `PipelineModule` is built (the benchmark against its pipeline engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built when `build` is called."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"a layer is a torch.nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer that shares one module with every other spec of the same `key` (a tied embedding
    and head): the module is built once; `forward_fn(module, x)`, when given, is what this
    position computes with it; `tied_weight_attr` names the shared parameters."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)
