"""Qwen3 (`Qwen3ForCausalLM`): Llama's block plus an RMSNorm over each head's queries and keys
(`q_norm`, `k_norm`, of head_dim; replicated under tensor parallelism, where each rank's heads
give only part of their gradient, summed over the group), an explicit head_dim."""

from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
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
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config_class=Qwen3Config,
    embedding=TokenEmbedding,
    block=rotary_block(Qwen3DecoderLayer, Qwen3RotaryEmbedding, ROTARY_TP_PLAN),
    final_norm=final_norm(Qwen3RMSNorm, "norm", "rms_norm_eps"),
    tp_plan=ROTARY_TP_PLAN,
    names=ROTARY_NAMES,
    check=rotary_checks,
)
