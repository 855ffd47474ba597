"""Config values dsnd cannot honour, found before anything starts: one line per field and value.

Blocks run `transformers`' own layers, so whatever those read from the config (rope type and
scaling, norm epsilons, activations, head_dim, biases, qk-norms) is honoured by construction.
What dsnd's wrapper changes is refused here: it trains without dropout (its random streams are
not layout-independent, so losses would differ between layouts), and it calls attention
without a mask (full causal), so a sliding window shorter than the sequence is refused.
Every key of a user's config.json must be one the config class knows (or harmless metadata):
a key dsnd cannot place might change the math.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dsnd.errors import shown

# Keys of config.json that describe the file or generation, not the network's math.
METADATA = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "task_specific_params",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "model_type",
        "initializer_range",
        "max_window_layers",
        # GPT-2's published files: leftovers of the double-heads model and of an old cache flag
        "n_special",
        "predict_special_tokens",
        "output_past",
    }
)
# Keys some published files carry that transformers' class no longer knows: fine while false.
FALSE_ONLY = frozenset({"use_mrope"})
# Keys some config classes do not declare that their model code reads when present (Qwen's MoE
# attention and rotary code take `getattr(config, "head_dim", hidden // heads)`): honoured.
UNDECLARED_READ: dict[str, frozenset[str]] = {
    "qwen2_moe": frozenset({"head_dim"}),
    "qwen3_moe": frozenset({"head_dim"}),
}
# 4.x spellings transformers 5 folds into rope_parameters (and so honours).
LEGACY = frozenset({"rope_theta", "rope_scaling", "partial_rotary_factor"})


def unknown_keys(raw: dict, config: PretrainedConfig) -> list[str]:
    """Keys of the raw config.json that `config`'s class does not define."""
    known = set(type(config)().to_dict()) | set(type(config).attribute_map) | METADATA | LEGACY
    known |= UNDECLARED_READ.get(config.model_type, frozenset())
    known |= {k for k in FALSE_ONLY if raw.get(k) is False}
    return [
        f"{key}={raw[key]!r}: not a {type(config).__name__} setting, so dsnd cannot tell "
        "what it does to the model"
        for key in sorted(raw)
        if key not in known
    ]


def rope_conflicts(raw: dict, config: PretrainedConfig) -> list[str]:
    """4.x rope keys beside a 5.x `rope_parameters` that says otherwise: transformers reads
    `rope_parameters` and drops the others silently."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_parameters" not in raw:
        return []
    out = []
    if "rope_theta" in raw and raw["rope_theta"] != params.get("rope_theta"):
        out.append(
            f"rope_theta={raw['rope_theta']!r} disagrees with rope_parameters."
            f"rope_theta={params.get('rope_theta')!r}; keep one of them"
        )
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict):
        for key, value in scaling.items():
            key = "rope_type" if key == "type" else key
            if params.get(key) != value:
                out.append(
                    f"rope_scaling.{key}={value!r} disagrees with rope_parameters.{key}="
                    f"{params.get(key)!r}; keep one of them"
                )
    return out


def divisors(config: PretrainedConfig) -> list[str]:
    """Values transformers' layers divide by, which no layout could build (Qwen-MoE's
    `decoder_sparse_step` 0: a ZeroDivisionError deep in the layer's constructor)."""
    step = getattr(config, "decoder_sparse_step", None)
    if isinstance(step, int) and step < 1:  # (transformers refuses other types itself)
        return [
            f"decoder_sparse_step={step}: must be an integer >= 1 (layer i is a mixture of "
            "experts when (i + 1) % decoder_sparse_step == 0; 1 = every layer)"
        ]
    return []


def no_dropout(config: PretrainedConfig, *fields: str) -> list[str]:
    return [
        f"{name}={getattr(config, name)}: dsnd trains without dropout (layouts would draw "
        f"different masks); set it to 0 (--set model.overrides.{name}=0)"
        for name in fields
        if getattr(config, name, 0) not in (0, 0.0, None)
    ]


def activation(config: PretrainedConfig, field: str) -> list[str]:
    value = getattr(config, field)
    if value in ACT2FN:
        return []
    known = ", ".join(sorted(ACT2FN))
    return [f"{field}={value!r}: not an activation transformers knows ({known})"]


def rope(config: PretrainedConfig) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta")
    if theta is not None and not (_number(theta) and math.isfinite(theta) and theta > 0):
        return [f"rope_theta={shown(theta)}: must be a finite number > 0 (the rotary base)"]
    kind = params.get("rope_type", "default")
    if kind == "default" or kind in ROPE_INIT_FUNCTIONS:
        return []
    return [
        f"rope_scaling.rope_type={kind!r}: transformers implements "
        f"{', '.join(['default', *sorted(ROPE_INIT_FUNCTIONS)])}"
    ]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def sliding_window(config: PretrainedConfig, seq_len: int) -> list[str]:
    """A window shorter than the sequence, on any layer that uses it."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= seq_len:
        return []
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return []  # e.g. Qwen2.5 with use_sliding_window false: every layer attends fully
    return [
        f"sliding_window={window}: shorter than model.seq_len={seq_len}; dsnd runs full "
        f"causal attention, so it would train another model (use seq_len <= {window})"
    ]


def rotary_checks(config: PretrainedConfig, seq_len: int) -> list[str]:
    """What Llama, Mistral, Qwen2 and Qwen3 configs may say that dsnd cannot honour."""
    out = no_dropout(config, "attention_dropout") + activation(config, "hidden_act")
    out += rope(config) + sliding_window(config, seq_len)
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        out.append(
            f"pretraining_tp={config.pretraining_tp}: transformers ignores it in "
            "training; set it to 1 to say the model is the plain one"
        )
    return out
