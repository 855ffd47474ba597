"""Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with routed
experts (top-k renormalised only with `norm_topk_prob`) plus an always-on shared expert scaled
by a sigmoid gate; `decoder_sparse_step` / `mlp_only_layers` make some layers dense."""

from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeDecoderLayer,
    Qwen2MoeRMSNorm,
    Qwen2MoeRotaryEmbedding,
)

from dsnd.model.decoder import rotary_family
from dsnd.model.family import ExpertFiles

FAMILY = rotary_family(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    Qwen2MoeConfig,
    Qwen2MoeDecoderLayer,
    Qwen2MoeRMSNorm,
    Qwen2MoeRotaryEmbedding,
    ExpertFiles(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
)
