"""Which model a run trains: a `transformers` config (a user's directory, a config.json, or a
preset shipped as one), with its family, checked before anything starts.

`load_model` reads the file, applies the run's overrides (shape keys and `model.overrides`) to
its raw keys, builds the config through the family's `transformers` config class (so the 4.x
spellings `rope_theta` / `rope_scaling` and the 5.x `rope_parameters` both work), and refuses,
one line per field and value, what dsnd cannot honour. Nothing is ever downloaded: a name that
is neither a preset nor a local path is an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from dsnd.errors import UserError
from dsnd.model.checks import (
    LEGACY,
    METADATA,
    UNDECLARED_READ,
    divisors,
    rope_conflicts,
    unknown_keys,
)
from dsnd.model.families import by_name, family_of, supported
from dsnd.model.family import Family

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
DEFAULT_PRESET = "llama-tiny"
TOKENIZER_DIRS = ("additional_chat_templates",)  # transformers' named templates: NAME.jinja
# What a model directory holds that is not its tokenizer: the network (config.json, weights and
# their index, in any format), and the marker of a dsnd export (each export writes its own)
_NETWORK_FILES = ("config.json", "dsnd-export.json")
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".npz",
    ".index.json",
)
# A directory holds a tokenizer when it holds one of these (config.json and weights alone do
# not): only then are its other files taken for the tokenizer's
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def tokenizer_files(directory: str | None) -> list[str]:
    """What an export of a model from `directory` carries on beside the weights it writes (paths
    relative to it, sorted): every top-level file but the network's (config, weights, index,
    export marker; hidden files neither), and `TOKENIZER_DIRS`' files — whatever the tokenizer
    was saved in, whichever names its class gives them: vocabulary, special tokens, generation
    defaults, and the chat template (transformers 5 writes it to chat_template.jinja, 4.x
    into tokenizer_config.json), which a fixed list of names once dropped from exports. A
    directory without a tokenizer (`_TOKENIZER_MARKERS`) gives nothing."""
    if not directory or not any(
        os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_MARKERS
    ):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name in TOKENIZER_DIRS and os.path.isdir(path):
            out += [
                f"{name}/{f}"
                for f in sorted(os.listdir(path))
                if not f.startswith(".") and os.path.isfile(os.path.join(path, f))
            ]
        elif _tokenizer_file(name, path):
            out.append(name)
    return out


def _tokenizer_file(name: str, path: str) -> bool:
    network = name in _NETWORK_FILES or name.lower().endswith(_WEIGHT_SUFFIXES)
    return os.path.isfile(path) and not name.startswith(".") and not network


def presets() -> list[str]:
    return sorted(f.removesuffix(".json") for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


@dataclass(frozen=True)
class ModelSpec:
    """A model: its family, its full `transformers` config, and where it came from."""

    family: Family
    config: PretrainedConfig
    source: str  # what logs call it: "preset gpt2", or the directory / file given
    directory: str | None = None  # a user's model directory (tokenizer files), None for presets

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        kv = getattr(self.config, "num_key_value_heads", None)
        return self.num_heads if kv is None else kv

    @property
    def head_dim(self) -> int:
        dim = getattr(self.config, "head_dim", None)
        return self.hidden_size // self.num_heads if dim is None else dim

    @property
    def ffn_size(self) -> int:
        c = self.config
        for name in ("intermediate_size", "n_inner"):
            if getattr(c, name, None) is not None:
                return getattr(c, name)
        return 4 * c.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.config.tie_word_embeddings)

    def describe(self) -> str:
        """One line: "llama (preset llama-tiny): hidden 64, 4 layers, 4 heads (2 kv), vocab 256"."""
        return (
            f"{self.family.name} ({self.source}): hidden {self.hidden_size}, "
            f"{self.num_layers} layers, {self.num_heads} heads ({self.num_kv_heads} kv), "
            f"vocab {self.vocab_size}"
        )

    def math(self) -> dict[str, Any]:
        """Every config value that changes the network (what a resume must match)."""
        return {k: v for k, v in self.config.to_dict().items() if k not in METADATA}

    def manifest(self) -> dict[str, Any]:
        """What a checkpoint records to rebuild this model (`from_manifest`)."""
        config = {
            k: v
            for k, v in self.config.to_dict().items()
            if k not in ("_name_or_path", "transformers_version")
        }
        entry = {"family": self.family.name, "source": self.source, "config": config}
        return entry | ({"directory": self.directory} if self.directory else {})


# What checkpoints written before model configs (dsnd 0.1) recorded: the tiny presets' shape.
LEGACY_SHAPE = {
    "hidden_size": "hidden_size",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "ffn_size": "ffn_size",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
}


def from_manifest(entry: dict[str, Any]) -> ModelSpec:
    """The model a checkpoint's manifest["model"] describes (also the shape-only entries of
    checkpoints written before configs were recorded: their family's tiny preset reshaped)."""
    if "config" not in entry:
        shape = {new: entry[old] for old, new in LEGACY_SHAPE.items()}
        overrides = {
            "tie_word_embeddings": entry["tie_embeddings"],
            "initializer_range": entry.get("init_std", 0.02),
        }
        return load_model(f"{entry['family']}-tiny", "manifest model", shape, overrides)
    family = by_name(entry["family"])
    config = _build(family, dict(entry["config"]))
    return ModelSpec(family, config, entry.get("source", "?"), entry.get("directory"))


def _build(family: Family, raw: dict[str, Any]) -> PretrainedConfig:
    config = family.config_class.from_dict(raw)
    config._attn_implementation = "sdpa"  # no mask → causal SDPA kernels (see decoder.py)
    # what from_pretrained picks for experts: one grouped matmul over a layer's experts
    # (transformers falls back to a loop where torch has no grouped matmul on the device)
    if family.moe:
        config._experts_implementation = "grouped_mm"
    return config


def _read(path: str, key: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: cannot read {path} ({e})") from e
    if not isinstance(raw, dict):
        raise UserError(f"{key}: {path} is not a JSON object")
    return raw


def locate(name: str, key: str) -> tuple[str, str, str | None]:
    """(config.json path, how logs name it, the model directory or None) of a preset name, a
    directory holding config.json, or a config.json file."""
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            raise UserError(f"{key}={name}: the directory has no config.json")
        return path, name, name
    if os.path.isfile(name):
        return name, name, os.path.dirname(os.path.abspath(name))
    if name in presets():
        return os.path.join(PRESET_DIR, f"{name}.json"), f"preset {name}", None
    raise UserError(
        f"{key}={name!r}: not a preset ({', '.join(presets())}) nor a local "
        "directory or config.json (dsnd never downloads models)"
    )


# run-config shape keys -> the config.json keys they set (first one the family's class knows)
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd"),
    "num_layers": ("num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "ffn_size": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
}


def _apply(
    family: Family, raw: dict[str, Any], shape: dict[str, int | None], overrides: dict[str, Any]
) -> dict[str, Any]:
    """`raw` with the run's overrides; when the width or heads change, head_dim follows
    (hidden / heads) unless it is given too, as it would for a config built from scratch."""
    out = dict(raw)
    known = set(family.config_class().to_dict()) | UNDECLARED_READ.get(family.name, frozenset())
    for key, value in shape.items():
        if value is None:
            continue
        names = [n for n in SHAPE_KEYS[key] if n in known]
        if not names:
            heads = shape.get("num_heads") or _get(raw, "num_heads")
            if key == "num_kv_heads" and value == heads:
                continue  # GPT-2: no grouped-query attention, kv heads == heads
            raise UserError(f"model.{key}: {family.name} models have no such setting")
        out[names[0]] = value
    if (
        "head_dim" in known
        and shape.get("head_dim") is None
        and (shape.get("hidden_size") is not None or shape.get("num_heads") is not None)
    ):
        out["head_dim"] = _get(out, "hidden_size") // _get(out, "num_heads")
    return _with_overrides(out, overrides)


def _with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`raw` with `model.overrides` as transformers 5 reads them: a 4.x rope key (rope_theta,
    partial_rotary_factor, rope_scaling's entries) on a config in the 5.x form goes into its
    `rope_parameters`, which transformers reads in place of those keys (so `rope_theta:
    500000` takes effect on either form); a `rope_parameters` override replaces the file's rope
    keys whole."""
    out = {**raw, **overrides}
    if "rope_parameters" in overrides:
        return {k: v for k, v in out.items() if k not in LEGACY - overrides.keys()}
    params = raw.get("rope_parameters")
    if not isinstance(params, dict):
        return out  # the 4.x form: the keys themselves are read
    folded = {k: overrides[k] for k in ("rope_theta", "partial_rotary_factor") if k in overrides}
    scaling = overrides.get("rope_scaling")
    if isinstance(scaling, dict):
        folded |= {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
    if folded:
        out["rope_parameters"] = {**params, **folded}
        for key in LEGACY & overrides.keys() - raw.keys():
            del out[key]  # folded in: not a second spelling beside rope_parameters
    return out


def _blamed(path: str, problem: str, overrides: dict[str, Any]) -> str:
    """Where a config problem lies: the key's `model.overrides` entry when the run set it, so
    that a user's override is not blamed on the file (a packaged preset) it was applied to."""
    key = problem.split("=", 1)[0].split(".", 1)[0]
    return f"model.overrides.{key} (applied to {path})" if key in overrides else path


def _get(raw: dict[str, Any], key: str) -> int:
    return next(raw[n] for n in SHAPE_KEYS[key] if raw.get(n) is not None)


def load_model(
    source: str,
    key: str,
    shape: dict[str, int | None] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ModelSpec:
    """The model `source` (preset, directory or config.json) names, with the run's overrides;
    `key` is the run-config key that named it, for errors. Raises UserError."""
    path, label, directory = locate(source, key)
    raw = _read(path, key)
    family = family_of(raw)
    if family is None:
        found = raw.get("architectures") or raw.get("model_type")
        raise UserError(
            f"{key}={source}: architecture {found!r} is not supported; dsnd trains "
            f"{', '.join(supported())}"
        )
    bad = [k for k in (overrides or {}) if k in ("architectures", "model_type")]
    if bad:
        raise UserError(f"model.overrides.{bad[0]}: choose another model.config instead")
    for name, value in (shape or {}).items():
        if value is not None and value < 1:  # before hidden // heads below divides by it
            raise UserError(f"{label}: {name} must be >= 1, got {value}")
    raw = _apply(family, raw, shape or {}, overrides or {})
    try:
        config = _build(family, raw)
    except (TypeError, ValueError, KeyError, ArithmeticError, StrictDataclassError) as e:
        e = e.__cause__ or e  # huggingface_hub wraps the validator's error in two lines
        raise UserError(f"{key}={source}: transformers refuses the config: {e}") from e
    problems = unknown_keys(raw, config) + rope_conflicts(raw, config) + divisors(config)
    if problems:
        raise UserError(f"{_blamed(path, problems[0], overrides or {})}: {problems[0]}")
    return ModelSpec(family, config, label, directory)


def check_model(model: ModelSpec, seq_len: int, where: str) -> None:
    """Refuse, one line each (the first raised), what the run cannot honour of the config."""
    if not 1 <= seq_len <= model.max_seq_len:
        raise UserError(
            f"model.seq_len={seq_len} must be in 1..{model.max_seq_len}, the "
            f"max_position_embeddings of {model.source}; raise it with "
            "model.max_position_embeddings if the model may run longer sequences"
        )
    for name in (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "ffn_size",
        "vocab_size",
        "head_dim",
    ):
        if getattr(model, name) < 1:
            raise UserError(f"{where}: {name} must be >= 1, got {getattr(model, name)}")
    if model.num_heads % model.num_kv_heads:
        raise UserError(
            f"{where}: num_attention_heads={model.num_heads} is not divisible by "
            f"num_key_value_heads={model.num_kv_heads}"
        )
    if getattr(model.config, "head_dim", None) is None and model.hidden_size % model.num_heads:
        raise UserError(
            f"{where}: hidden_size={model.hidden_size} is not divisible by "
            f"num_attention_heads={model.num_heads}"
        )
    problems = model.family.check(model.config, seq_len)
    if problems:
        raise UserError(
            f"{where}: {problems[0]}"
            + (
                f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})"
                if len(problems) > 1
                else ""
            )
        )
