"""Mixture-of-experts blocks as `transformers` configures them: each token goes to the
`num_experts_per_tok` (top-k) of a layer's experts its router scores highest, no token dropped
(Mixtral, Qwen2-MoE, Qwen3-MoE route this way; none has a capacity limit). The blocks are
`transformers`' own layers, so whatever they read (top-k, expert count and sizes, Qwen's
`norm_topk_prob`, shared expert and its gate, `decoder_sparse_step` / `mlp_only_layers`) is
honoured by construction; what dsnd cannot honour yet is refused here by name.
"""

from __future__ import annotations

import re

from torch import nn
from transformers import PretrainedConfig

from dsnd.model.checks import rotary_checks

EXPERT_WEIGHTS = re.compile(r"(^|\.)mlp\.experts\.(gate_up_proj|down_proj)$")
"""In-memory names of the fused 3-D expert weights (E, ., .) of an MoE block."""


def moe_router(layer: nn.Module) -> nn.Module | None:
    """`layer`'s top-k router (`mlp.gate` of every `transformers` MoE block: it returns
    (logits, weights, expert ids)), or None in a dense layer."""
    router = getattr(getattr(layer, "mlp", None), "gate", None)
    return router if router is not None and hasattr(router, "top_k") else None


def experts_key(config: PretrainedConfig) -> str:
    """The config key of the routed-expert count (Mixtral's `num_local_experts`, Qwen's
    `num_experts`)."""
    for name in ("num_local_experts", "num_experts"):
        if getattr(config, name, None) is not None:
            return name
    raise AttributeError(f"{type(config).__name__} names no expert count")


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (Mixtral's `num_local_experts`, Qwen's `num_experts`)."""
    return getattr(config, experts_key(config))


def expert_layers(config: PretrainedConfig) -> list[int]:
    """The decoder layers with routed experts, as transformers' Qwen MoE layers choose them:
    not in `mlp_only_layers`, and every `decoder_sparse_step`-th (Mixtral: every layer)."""
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def active_share(config: PretrainedConfig) -> float:
    """The share of a layer's routed-expert weights one token multiplies: top-k / experts."""
    return config.num_experts_per_tok / num_experts(config)


def token_ffn(config: PretrainedConfig) -> int:
    """The MLP width one token's activations span in an MoE layer: its top-k experts'
    intermediate width (Qwen's `moe_intermediate_size`, Mixtral's `intermediate_size`) plus
    the shared expert's (Qwen2-MoE). Layers made dense (`mlp_only_layers`) are not told apart."""
    expert = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0
    return config.num_experts_per_tok * expert + shared


def moe_checks(config: PretrainedConfig, seq_len: int) -> list[str]:
    """What a Mixtral / Qwen2-MoE / Qwen3-MoE config may say that dsnd cannot honour: the
    rotary families' refusals, plus router noise (random multipliers, which layouts would draw
    differently, like dropout) and a top-k the experts cannot fill. (The router's
    load-balancing loss, `output_router_logits`, is honoured: `dsnd.moe.router_aux`; the
    layouts it needs are checked with the run's.)"""
    out = rotary_checks(config, seq_len)
    experts, top_k = num_experts(config), config.num_experts_per_tok
    if experts < 1:  # before top-k, which it would otherwise be blamed on
        out.append(f"{experts_key(config)}={experts}: must be >= 1 (routed experts per layer)")
    elif not 1 <= top_k <= experts:
        out.append(
            f"num_experts_per_tok={top_k}: must be in 1..{experts}, the number of experts per layer"
        )
    if getattr(config, "router_jitter_noise", 0) not in (0, 0.0, None):
        out.append(
            f"router_jitter_noise={config.router_jitter_noise}: dsnd trains without "
            "random router noise (layouts would draw different noise); set it to 0 "
            "(--set model.overrides.router_jitter_noise=0)"
        )
    return out
