"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, fused q|k|v Conv1D attention,
GELU MLP, biases everywhere, head tied to the token embedding."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, PretrainedConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from dsnd.cp.context import ContextParallel, attention_config
from dsnd.model.checks import activation, no_dropout
from dsnd.model.decoder import context_split, embedding_logits, final_norm, split, vocab_embedding
from dsnd.model.documents import Documents, active
from dsnd.model.family import Family, HFNames, TPPlan
from dsnd.model.parallelize import parallelize
from dsnd.tp.context import TensorParallel

TP_PLAN = TPPlan(
    enter=("attn", "mlp"),
    column={"attn.c_attn": 3, "mlp.c_fc": 1},  # q|k|v: each of the three split separately
    row=("attn.c_proj", "mlp.c_proj"),
    divide=("attn.split_size",),  # the width of each of q, k, v this rank holds
)


class Embedding(nn.Module):
    """Token ids (batch, seq) → token plus learned position embeddings (`wte`, `wpe`).
    Over a tensor-parallel group `wte` is split by vocabulary and `wpe` replicated; under
    sequence parallelism the output is this rank's slice of the sequence. Under context
    parallelism the token ids are this rank's slice and take their global positions."""

    tied_weight_attr = "wte.weight"

    def __init__(
        self,
        config: PretrainedConfig,
        tp: TensorParallel | None = None,
        cp: ContextParallel | None = None,
        documents: Documents | None = None,
    ) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        self.documents = documents
        self.tp = tp if split(tp) else None
        self.cp = cp if context_split(cp) else None
        self.wte = vocab_embedding(config, tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        if self.tp is not None:
            self.tp.mark_replicated(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if active(self.documents):  # packed documents: positions restart at each one
            positions = self.documents.positions(input_ids.device)
        elif self.cp is not None:
            positions = self.cp.positions(input_ids.shape[1] * self.cp.size, input_ids.device)
            positions = positions.unsqueeze(0)
        else:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if self.tp is not None and self.tp.sequence_parallel:
            positions = positions.chunk(self.tp.size, dim=1)[self.tp.rank]
        return self.wte(input_ids) + self.wpe(positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head: hidden @ wte.weight.T."""
        return embedding_logits(self.wte, hidden)


class Block(GPT2Block):
    """`GPT2Block` called with hidden states only (no cache, no mask → causal SDPA; packed
    documents: their block-diagonal mask)."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        tp: TensorParallel | None = None,
        cp: ContextParallel | None = None,
        documents: Documents | None = None,
    ) -> None:
        super().__init__(attention_config(config, cp), layer_idx=layer_idx)
        self.init_std = config.initializer_range
        self.documents = documents
        self.cp = cp if context_split(cp) else None
        if split(tp):
            parallelize(self, TP_PLAN, tp)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        extra = {"context_parallel": self.cp} if self.cp is not None else {}
        mask = self.documents.mask(hidden_states.device) if active(self.documents) else None
        return super().forward(hidden_states, attention_mask=mask, **extra)


def check(config: PretrainedConfig, seq_len: int) -> list[str]:
    out = no_dropout(config, "resid_pdrop", "embd_pdrop", "attn_pdrop")
    out += activation(config, "activation_function")
    for name in ("add_cross_attention", "reorder_and_upcast_attn"):
        if getattr(config, name, False):
            out.append(
                f"{name}=true: not supported by dsnd's GPT-2 (a decoder-only LM "
                "without cross-attention, attention in the input dtype)"
            )
    return out


FAMILY = Family(
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    model_types=("gpt2",),
    config_class=GPT2Config,
    embedding=Embedding,
    block=Block,
    final_norm=final_norm(nn.LayerNorm, "ln_f", "layer_norm_epsilon"),
    tp_plan=TP_PLAN,
    names=HFNames(
        base="transformer.",
        blocks="transformer.h.",
        embedding=("wte", "wpe"),
        final_norm="ln_f",
        tied_attr=Embedding.tied_weight_attr,
    ),
    check=check,
)
