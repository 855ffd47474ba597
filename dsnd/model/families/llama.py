"""Llama 2, 3, 3.1, 3.2 (`LlamaForCausalLM`): RMSNorm, rotary (with Llama 3's rope scaling),
grouped-query attention, SwiGLU MLP; optional attention and MLP biases; tied or untied head."""

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from dsnd.model.checks import rotary_checks
from dsnd.model.decoder import (
    ROTARY_NAMES,
    ROTARY_TP_PLAN,
    TokenEmbedding,
    final_norm,
    rotary_block,
)
from dsnd.model.family import Family

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config_class=LlamaConfig,
    embedding=TokenEmbedding,
    block=rotary_block(LlamaDecoderLayer, LlamaRotaryEmbedding, ROTARY_TP_PLAN),
    final_norm=final_norm(LlamaRMSNorm, "norm", "rms_norm_eps"),
    tp_plan=ROTARY_TP_PLAN,
    names=ROTARY_NAMES,
    check=rotary_checks,
)
