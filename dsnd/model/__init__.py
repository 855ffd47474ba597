"""Decoder-only transformers (Llama, GPT-2) as flat layer lists for DeepSpeed pipeline stages."""

from dsnd.model.hf_config import hf_config
from dsnd.model.hf_weights import from_hf_state_dict, to_hf_state_dict
from dsnd.model.loss import lm_loss
from dsnd.model.param_groups import param_groups
from dsnd.model.specs import LayerStack, build_model, init_layer, layer_specs

__all__ = [
    "LayerStack",
    "build_model",
    "from_hf_state_dict",
    "hf_config",
    "init_layer",
    "layer_specs",
    "lm_loss",
    "param_groups",
    "to_hf_state_dict",
]
