"""Decoder-only transformer layers, one `forward(tensor) -> tensor` each.

The model is the flat sequence embedding → blocks → final norm → head, so each layer can be a
DeepSpeed pipeline `LayerSpec`. Blocks subclass the `transformers` layers (attention, MLP and
norms are theirs); they only add what `LlamaModel` / `GPT2Model` would otherwise pass in:
position ids `arange(seq)`, Llama's rotary (cos, sin), and no attention mask, which makes SDPA
attention causal. Sequences therefore always start at position 0 (training without KV cache).

Every layer records `init_std` (the config's `initializer_range`) for `dsnd.model.specs.init_layer`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """Position ids (1, seq) for a (batch, seq, ...) tensor, broadcast over the batch."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


# --- Llama -----------------------------------------------------------------------------------


class LlamaEmbedding(nn.Module):
    """Token ids (batch, seq) → hidden states (batch, seq, hidden)."""

    tied_weight_attr = "embed_tokens.weight"

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head: hidden @ embed_tokens.weight.T."""
        return nn.functional.linear(hidden, self.embed_tokens.weight)


class LlamaBlock(LlamaDecoderLayer):
    """`LlamaDecoderLayer` that computes its own rotary embedding from positions 0..seq-1.

    The rotary module holds only non-persistent buffers (no parameters, nothing in the state
    dict), so each block owning one costs nothing and keeps the block self-contained for a stage.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.init_std = config.initializer_range
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        position_ids = _positions(hidden_states)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        return super().forward(
            hidden_states,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )


class LlamaFinalNorm(nn.Module):
    """The RMSNorm after the last block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


# --- GPT-2 -----------------------------------------------------------------------------------


class GPT2Embedding(nn.Module):
    """Token ids (batch, seq) → token plus learned position embeddings (batch, seq, hidden)."""

    tied_weight_attr = "wte.weight"

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(_positions(input_ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head: hidden @ wte.weight.T."""
        return nn.functional.linear(hidden, self.wte.weight)


class GPT2BlockLayer(GPT2Block):
    """`GPT2Block` called with hidden states only (no cache, no mask → causal SDPA)."""

    def __init__(self, config: GPT2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx=layer_idx)
        self.init_std = config.initializer_range

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hidden_states, attention_mask=None)


class GPT2FinalNorm(nn.Module):
    """The LayerNorm after the last block (`ln_f`)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)


# --- heads -----------------------------------------------------------------------------------


class LMHead(nn.Module):
    """Untied output projection hidden → vocab logits (Llama, or GPT-2 without tying)."""

    def __init__(self, config: LlamaConfig | GPT2Config) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tied_logits(embedding: LlamaEmbedding | GPT2Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """`TiedLayerSpec.forward_fn` of the head: logits from the shared embedding module."""
    return embedding.logits(hidden)
