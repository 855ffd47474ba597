"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k RMSNorms)
with routed experts, no shared expert; `norm_topk_prob`, `decoder_sparse_step` and
`mlp_only_layers` as in Qwen2-MoE."""

from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)

from dsnd.model.decoder import rotary_family
from dsnd.model.family import ExpertFiles

FAMILY = rotary_family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    Qwen3MoeConfig,
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
    ExpertFiles(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
)
