"""Llama 2, 3, 3.1, 3.2 (`LlamaForCausalLM`): RMSNorm, rotary (with Llama 3's rope scaling),
grouped-query attention, SwiGLU MLP; optional attention and MLP biases; tied or untied head."""

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from dsnd.model.decoder import rotary_family

FAMILY = rotary_family(
    "llama", "LlamaForCausalLM", LlamaConfig, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
)
