"""The routers' load-balancing loss of a mixture-of-experts model whose config sets
`output_router_logits: true`, as `transformers` adds it to each forward's language-model loss
(its `load_balancing_loss_func`, Switch Transformer's):

    router_aux_loss_coef * E * sum_e f_e * p_e,    f = C / R,  p = S / R

over every MoE layer's tokens of one forward pooled: C_e the (token, choice) assignments to
expert e (top-k of the router's softmax), S_e the sum of the router's probability of e, R the
rows (tokens times MoE layers). The pooling couples all layers of a forward, so under pipeline
parallelism each stage adds its layers' share to running sums that travel with the activations
(`sums`, `loss`): a stage's forward hooks on its routers collect the logits (not again when
activation checkpointing recomputes a block inside backward); `partial()` turns them into this
stage's (S, C, layers) per token, which the executor adds to what the previous stage sent and
hands on; the last stage's loss is then transformers'. The gradient of S flows back through the
pipeline's own messages with the activations' (C counts, no gradient), so every schedule, ZeRO
stage and the loss scaling treat it as they treat the activations. The sums travel in the
activations' dtype: exact in fp32, to bf16's precision in a bf16 run.

Under sequence parallelism each tensor-parallel rank routes a slice of the tokens: the last
stage sums the ranks' running sums (Megatron's g: all-reduce forward, identity backward, so each
rank's routers get their own tokens' gradient, which the sequence-parallel gradient sum then adds
up); per-token shares over a tp-th of the tokens summed tp times give the same loss. Context
parallelism is refused before start (`dsnd.config.parallel_rules.check_router_aux`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from dsnd.model.checkpointing import in_recompute
from dsnd.model.moe_config import moe_router, num_experts
from dsnd.tp.mappings import reduce_from_tp


def wants_router_aux(config: PretrainedConfig) -> bool:
    """Whether `config` asks for the load-balancing loss (`output_router_logits`)."""
    return bool(getattr(config, "output_router_logits", False))


class RouterAux:
    """The load-balancing loss's share of the MoE layers of `stack` (a `LayerStack`)."""

    def __init__(
        self,
        stack: nn.Module,
        config: PretrainedConfig,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.sequence_group = sequence_group  # the ranks sharing each sequence's tokens (SP)
        self.coef = config.router_aux_loss_coef
        self.experts, self.top_k = num_experts(config), config.num_experts_per_tok
        self.width = 2 * self.experts + 1  # what `partial` gives: S and C per token, layers
        self._logits: list[torch.Tensor] = []
        self._handles = []
        for layer in stack.modules():
            router = moe_router(layer)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._collect))

    def _collect(self, _module: nn.Module, _inputs, output) -> None:
        if not in_recompute():
            self._logits.append(output[0])

    def partial(self, device: torch.device) -> torch.Tensor:
        """This stage's (S / T, C / T, MoE layers) of the forward just run (T its tokens), in
        fp32, S with its gradient; forgets the logits."""
        logits, self._logits = self._logits, []
        sums = torch.zeros(self.width, device=device)
        for layer in logits:  # (T, E) each, as transformers' function reads them
            probs = torch.softmax(layer.float(), dim=-1)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
            tokens = probs.shape[0]
            # a scatter, not bincount: no device-to-host sync on the GPU
            counts = torch.zeros(self.experts, device=device).scatter_add_(
                0, chosen, torch.ones(chosen.shape, device=device)
            )
            sums = sums + torch.cat(
                [probs.sum(0) / tokens, counts / tokens, torch.ones(1, device=device)]
            )
        return sums

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The coefficient times transformers' loss of the whole forward's `sums`."""
        e = self.experts
        if self.sequence_group is not None:
            sums = reduce_from_tp(sums, self.sequence_group)
        layers = sums[-1].detach().clamp(min=1)  # (no MoE layer at all: S = C = 0, loss 0)
        return self.coef * e * (sums[:e] * sums[e : 2 * e].detach()).sum() / layers**2
