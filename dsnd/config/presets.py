"""Model presets as plain numbers (no torch), so configs can be checked before anything starts.

`dsnd.model` turns a `ModelDims` into a `transformers` config and layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelDims:
    """The shape of a decoder-only transformer."""

    family: str  # "llama" or "gpt2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # == num_heads for GPT-2 (no grouped-query attention)
    ffn_size: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, ModelDims] = {
    "llama-tiny": ModelDims(
        family="llama",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=176,
        vocab_size=256,
        max_seq_len=128,
        tie_embeddings=False,
    ),
    "gpt2-tiny": ModelDims(
        family="gpt2",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        ffn_size=256,
        vocab_size=256,
        max_seq_len=128,
        tie_embeddings=True,
    ),
}


def with_overrides(dims: ModelDims, **overrides: int | None) -> ModelDims:
    """`dims` with every non-None override applied (GPT-2 keeps kv heads == heads)."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    out = replace(dims, **changes)
    if out.family == "gpt2" and "num_kv_heads" not in changes:
        out = replace(out, num_kv_heads=out.num_heads)
    return out
