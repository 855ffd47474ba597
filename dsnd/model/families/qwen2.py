"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama's block with biases on q, k and v (split with
their columns under tensor parallelism), often a tied head (0.5B-3B); a sliding window only on
the layers `layer_types` marks (none unless `use_sliding_window`)."""

from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

from dsnd.model.decoder import rotary_family

FAMILY = rotary_family(
    "qwen2", "Qwen2ForCausalLM", Qwen2Config, Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding
)
