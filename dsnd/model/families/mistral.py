"""Mistral (`MistralForCausalLM`): Llama's block with its own classes; `sliding_window` (v0.1:
4096) is honoured while it is at least model.seq_len and refused when shorter."""

from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from dsnd.model.decoder import rotary_family

FAMILY = rotary_family(
    "mistral",
    "MistralForCausalLM",
    MistralConfig,
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)
