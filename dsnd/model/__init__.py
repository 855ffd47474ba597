"""The supported transformers families as flat layer lists for stages, with HF weights.

Decoder-only transformers of the supported families (`dsnd.model.families`) as flat layer
lists for DeepSpeed pipeline stages, built from `transformers` configs.
"""

from dsnd.model.hf_weights import from_hf_state_dict, to_hf_state_dict
from dsnd.model.loss import lm_loss
from dsnd.model.param_groups import param_groups
from dsnd.model.source import ModelSpec, load_model
from dsnd.model.stack import LayerStack, build_model, init_layer, layer_specs

__all__ = [
    "LayerStack",
    "ModelSpec",
    "build_model",
    "from_hf_state_dict",
    "init_layer",
    "layer_specs",
    "lm_loss",
    "load_model",
    "param_groups",
    "to_hf_state_dict",
]
