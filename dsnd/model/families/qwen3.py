"""Qwen3 (`Qwen3ForCausalLM`): Llama's block plus an RMSNorm over each head's queries and keys
(`q_norm`, `k_norm`, of head_dim; replicated under tensor parallelism, where each rank's heads
give only part of their gradient, summed over the group), an explicit head_dim."""

from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from dsnd.model.decoder import rotary_family

FAMILY = rotary_family(
    "qwen3", "Qwen3ForCausalLM", Qwen3Config, Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
)
