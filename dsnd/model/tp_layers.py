"""The layers of `dsnd.model.layers` split over a tensor-parallel group (parallel.tp > 1).

Parameter names and FULL shapes are those of the single-process layers (and of `transformers`),
each rank holding its `Shard` of every split tensor, so initialisation, Hugging Face weights and
checkpoints mean the same tensors on every layout.

- Llama has no biases, so the `transformers` decoder layer built for this rank's share of the
  heads (num_heads / tp, num_kv_heads / tp, intermediate_size / tp; head_dim unchanged) holds
  exactly the Megatron shards: q, k, v, gate, up split by rows, o and down by columns. The block
  only adds f after each norm and g after attention and after the MLP (2 all-reduces forward,
  2 backward; with sequence parallelism an all-gather and a reduce-scatter each).
- GPT-2 fuses q|k|v in one Conv1D and adds biases after its row layers, so its block is written
  out on `dsnd.tp` layers in the Conv1D layout (c_attn split with stride 3).
- Embeddings and heads split the vocabulary (padded to a multiple of tp); the last stage's
  logits stay split for `vocab_parallel_cross_entropy`.

Under sequence parallelism hidden states between blocks (and between pipeline stages) are
this rank's slice of the sequence; every replicated parameter is marked `sequence_parallel`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GPT2Config, LlamaConfig
from transformers.activations import ACT2FN

from dsnd.model.layers import GPT2FinalNorm, LlamaBlock, LlamaFinalNorm
from dsnd.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    VocabParallelHead,
    mark_split,
)
from dsnd.tp.context import TensorParallel
from dsnd.tp.layers import divide


def _sequence_positions(hidden: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Position ids (1, seq) of the FULL sequence `hidden` (maybe a sequence slice) belongs to."""
    seq = hidden.shape[1] * (tp.size if tp.sequence_parallel else 1)
    return torch.arange(seq, device=hidden.device).unsqueeze(0)


# --- Llama -----------------------------------------------------------------------------------


def local_llama_config(config: LlamaConfig, tp: int) -> LlamaConfig:
    """`config` with this rank's share of heads and MLP width (head_dim stays)."""
    local = copy.deepcopy(config)
    local.num_attention_heads = divide(config.num_attention_heads, tp, "num_heads")
    local.num_key_value_heads = divide(config.num_key_value_heads, tp, "num_kv_heads")
    local.intermediate_size = divide(config.intermediate_size, tp, "ffn_size")
    local.head_dim = config.head_dim
    return local


class TPLlamaEmbedding(nn.Module):
    tied_weight_attr = "embed_tokens.weight"

    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.group, tp.sequence_parallel
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.logits(hidden)


class TPLlamaBlock(LlamaBlock):
    """`LlamaDecoderLayer` over this rank's heads, with f/g around attention and the MLP."""

    def __init__(self, config: LlamaConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(local_llama_config(config, tp.size), layer_idx)
        self.tp = tp
        attn, mlp = self.self_attn, self.mlp
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        ffn = config.intermediate_size
        for linear, full, dim in ((attn.q_proj, q, 0), (attn.k_proj, kv, 0), (attn.v_proj, kv, 0),
                                  (attn.o_proj, q, 1), (mlp.gate_proj, ffn, 0),
                                  (mlp.up_proj, ffn, 0), (mlp.down_proj, ffn, 1)):  # fmt: skip
            if linear.bias is not None:
                raise ValueError("tensor-parallel Llama blocks have no biases")
            mark_split(linear.weight, Shard(dim, tp.rank, tp.size, full))
        tp.mark_replicated(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tp = self.tp
        positions = _sequence_positions(hidden_states, tp)
        rope = self.rotary_emb(hidden_states, positions)
        x = tp.enter(self.input_layernorm(hidden_states))
        x, _ = self.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=None)
        hidden_states = hidden_states + tp.leave(x)
        x = tp.enter(self.post_attention_layernorm(hidden_states))
        return hidden_states + tp.leave(self.mlp(x))


class TPLlamaFinalNorm(LlamaFinalNorm):
    def __init__(self, config: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__(config)
        tp.mark_replicated(self)


class TPLMHead(nn.Module):
    """Untied output projection, split by vocabulary: this rank's slice of the logits."""

    def __init__(self, config: LlamaConfig | GPT2Config, tp: TensorParallel) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.lm_head = VocabParallelHead(
            config.vocab_size, config.hidden_size, tp.group, tp.sequence_parallel, 1
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


# --- GPT-2 -----------------------------------------------------------------------------------


class TPGPT2Embedding(nn.Module):
    """Vocab-parallel token embedding plus replicated learned positions."""

    tied_weight_attr = "wte.weight"

    def __init__(self, config: GPT2Config, tp: TensorParallel) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.tp = tp
        self.wte = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.group, tp.sequence_parallel
        )
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        tp.mark_replicated(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tokens = self.wte(input_ids)  # a sequence slice under sequence parallelism
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if self.tp.sequence_parallel:
            positions = positions.chunk(self.tp.size, dim=1)[self.tp.rank]
        return tokens + self.wpe(positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.wte.logits(hidden)


class TPGPT2Attention(nn.Module):
    """Causal self-attention over this rank's heads: fused q|k|v column layer, row c_proj."""

    def __init__(self, config: GPT2Config, tp: TensorParallel) -> None:
        super().__init__()
        h, sp = config.hidden_size, tp.sequence_parallel
        self.heads = divide(config.num_attention_heads, tp.size, "num_heads")
        self.head_dim = h // config.num_attention_heads
        self.c_attn = ColumnParallelLinear(h, 3 * h, tp.group, sequence_parallel=sp,
                                           transposed=True, stride=3)  # fmt: skip
        self.c_proj = RowParallelLinear(h, h, tp.group, sequence_parallel=sp, transposed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.heads * self.head_dim, dim=-1)
        batch, seq, _ = q.shape
        q, k, v = (t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # GPT-2's scaling (head_dim ** -0.5) is SDPA's default; dropout is 0 (hf_config)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class TPGPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config, tp: TensorParallel) -> None:
        super().__init__()
        h, sp = config.hidden_size, tp.sequence_parallel
        ffn = config.n_inner if config.n_inner is not None else 4 * h
        self.c_fc = ColumnParallelLinear(h, ffn, tp.group, sequence_parallel=sp, transposed=True)
        self.c_proj = RowParallelLinear(ffn, h, tp.group, sequence_parallel=sp, transposed=True)
        self.act = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class TPGPT2Block(nn.Module):
    """Pre-norm GPT-2 block; names as `transformers`' GPT2Block (ln_1, attn, ln_2, mlp)."""

    def __init__(self, config: GPT2Config, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(h, eps=eps)
        self.attn = TPGPT2Attention(config, tp)
        self.ln_2 = nn.LayerNorm(h, eps=eps)
        self.mlp = TPGPT2MLP(config, tp)
        tp.mark_replicated(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class TPGPT2FinalNorm(GPT2FinalNorm):
    def __init__(self, config: GPT2Config, tp: TensorParallel) -> None:
        super().__init__(config)
        tp.mark_replicated(self)
