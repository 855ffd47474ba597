"""Mistral (`MistralForCausalLM`): Llama's block with its own classes; `sliding_window` (v0.1:
4096) is honoured while it is at least model.seq_len and refused when shorter."""

from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
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
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    config_class=MistralConfig,
    embedding=TokenEmbedding,
    block=rotary_block(MistralDecoderLayer, MistralRotaryEmbedding, ROTARY_TP_PLAN),
    final_norm=final_norm(MistralRMSNorm, "norm", "rms_norm_eps"),
    tp_plan=ROTARY_TP_PLAN,
    names=ROTARY_NAMES,
    check=rotary_checks,
)
