"""`ModelDims` → the `transformers` config whose layers dsnd wraps.

Every dropout is 0 (GPT2Config defaults resid/embd/attn/summary dropout to 0.1), so a model built
from these configs gives the same numbers on every layout and matches the HF model in parity tests.
Attention is SDPA and is called without a mask, so it is causal (`is_causal=True` in the kernel).
"""

from __future__ import annotations

from transformers import GPT2Config, LlamaConfig

from dsnd.config.presets import ModelDims


def hf_config(dims: ModelDims) -> LlamaConfig | GPT2Config:
    """The `LlamaConfig` / `GPT2Config` describing `dims` (byte-level vocab, no special tokens)."""
    if dims.family == "llama":
        return LlamaConfig(
            vocab_size=dims.vocab_size,
            hidden_size=dims.hidden_size,
            intermediate_size=dims.ffn_size,
            num_hidden_layers=dims.num_layers,
            num_attention_heads=dims.num_heads,
            num_key_value_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            max_position_embeddings=dims.max_seq_len,
            initializer_range=dims.init_std,
            tie_word_embeddings=dims.tie_embeddings,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            attn_implementation="sdpa",
        )
    if dims.family == "gpt2":
        if dims.num_kv_heads != dims.num_heads:
            raise ValueError(
                f"GPT-2 has no grouped-query attention: num_kv_heads ({dims.num_kv_heads}) "
                f"must equal num_heads ({dims.num_heads})"
            )
        return GPT2Config(
            vocab_size=dims.vocab_size,
            n_positions=dims.max_seq_len,
            n_embd=dims.hidden_size,
            n_layer=dims.num_layers,
            n_head=dims.num_heads,
            n_inner=dims.ffn_size,
            initializer_range=dims.init_std,
            tie_word_embeddings=dims.tie_embeddings,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            attn_implementation="sdpa",
        )
    raise ValueError(f"unknown model family {dims.family!r}; expected 'llama' or 'gpt2'")
