"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a mixture-of-experts MLP, the
router's softmax top-k renormalised over the chosen experts; files name the block
`block_sparse_moe` and its experts' projections w1 (gate), w3 (up), w2 (down)."""

from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
)

from dsnd.model.decoder import rotary_family
from dsnd.model.family import ExpertFiles

FAMILY = rotary_family(
    "mixtral",
    "MixtralForCausalLM",
    MixtralConfig,
    MixtralDecoderLayer,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
    ExpertFiles(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
)
