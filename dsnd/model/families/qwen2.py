"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama's block with biases on q, k and v (split with
their columns under tensor parallelism), often a tied head (0.5B-3B); a sliding window only on
the layers `layer_types` marks (none unless `use_sliding_window`)."""

from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
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
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    config_class=Qwen2Config,
    embedding=TokenEmbedding,
    block=rotary_block(Qwen2DecoderLayer, Qwen2RotaryEmbedding, ROTARY_TP_PLAN),
    final_norm=final_norm(Qwen2RMSNorm, "norm", "rms_norm_eps"),
    tp_plan=ROTARY_TP_PLAN,
    names=ROTARY_NAMES,
    check=rotary_checks,
)
