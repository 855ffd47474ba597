"""The routers' load-balancing loss of a mixture-of-experts model whose config sets
`output_router_logits: true`, as `transformers` adds it to the language-model loss:
``router_aux_loss_coef * load_balancing_loss_func(router logits of every MoE layer, E, k)``
(Switch Transformer's E · Σ_e f_e · p_e, with f_e the share of (token, choice) assignments to
expert e and p_e its mean router probability, both pooled over every MoE layer's tokens of the
forward). `transformers`' own function of the family computes it, from the logits that forward
hooks on this stage's routers collect during one micro-batch's forward (not again when
activation checkpointing recomputes a block inside backward).

The loss couples all MoE layers of a forward, so it needs them on one stage (`parallel.pp` 1)
and every token of a sequence on the rank (no sequence or context parallelism): the run config
refuses the rest before start (`dsnd.config.resolve.check_router_aux`).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from transformers import PretrainedConfig

from dsnd.model.moe import num_experts


def wants_router_aux(config: PretrainedConfig) -> bool:
    """Whether `config` asks for the load-balancing loss (`output_router_logits`)."""
    return bool(getattr(config, "output_router_logits", False))


class RouterAux:
    """Collects one forward's router logits from the MoE layers of `stack` (a `LayerStack`);
    `pop()` gives their load-balancing loss, times the coefficient, and forgets them."""

    def __init__(self, stack: nn.Module, config: PretrainedConfig) -> None:
        module = importlib.import_module(
            f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        self._loss_fn = module.load_balancing_loss_func
        self.coef = config.router_aux_loss_coef
        self.experts, self.top_k = num_experts(config), config.num_experts_per_tok
        self._logits: list[torch.Tensor] = []
        self._handles = []
        for layer in stack.modules():
            router = getattr(getattr(layer, "mlp", None), "gate", None)
            if router is not None and hasattr(router, "top_k"):
                self._handles.append(router.register_forward_hook(self._collect))

    def _collect(self, _module: nn.Module, _inputs, output) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a checkpoint's recompute
            self._logits.append(output[0])

    def pop(self) -> torch.Tensor:
        """The coefficient times the loss of the logits collected since the last `pop`."""
        logits, self._logits = tuple(self._logits), []
        if not logits:
            raise RuntimeError("no router logits collected for the load-balancing loss")
        return self.coef * self._loss_fn(logits, self.experts, self.top_k)
