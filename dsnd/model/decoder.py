"""Layers every supported family shares: token embedding, final norm, output head, and the
rotary decoder block built around a `transformers` decoder layer.

Each layer has `forward(tensor) -> tensor`, so it can be a DeepSpeed pipeline `LayerSpec`, and
takes `tp` (a `TensorParallel`, or None on one rank). Blocks are the `transformers` layers
themselves (attention, MLP, norms, rotary code are theirs); dsnd only adds what the HF model
would pass in: position ids `arange(seq)`, the rotary (cos, sin), and no attention mask, which
makes SDPA attention causal (with packed documents, `dsnd.model.documents`' positions and
block-diagonal mask instead). Sequences therefore always start at position 0 (training without a
KV cache). Every layer records `init_std` (the config's `initializer_range`) for
`dsnd.model.stack.init_layer`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from dsnd.cp.context import ContextParallel, attention_config
from dsnd.model.checks import rotary_checks
from dsnd.model.documents import Documents, active
from dsnd.model.family import ExpertFiles, Family, HFNames, TPPlan
from dsnd.model.moe_config import moe_checks
from dsnd.model.parallelize import parallelize
from dsnd.tp import VocabParallelEmbedding, VocabParallelHead
from dsnd.tp.context import TensorParallel


def split(tp: TensorParallel | None) -> bool:
    """Whether `tp` names a group of several ranks (else the layer is built whole)."""
    return tp is not None and tp.size > 1


def context_split(cp: ContextParallel | None) -> bool:
    """Whether `cp` names a group of several ranks (else sequences are whole on each rank)."""
    return cp is not None and cp.size > 1


def sequence_positions(
    hidden: torch.Tensor, tp: TensorParallel | None, cp: ContextParallel | None = None
) -> torch.Tensor:
    """Position ids (1, seq) of the tokens attention sees on this rank: the whole sequence, or
    under context parallelism this rank's slice of it, at their global positions (under
    sequence parallelism `hidden` is this rank's tensor-parallel share of those tokens)."""
    seq = hidden.shape[1] * (tp.size if split(tp) and tp.sequence_parallel else 1)
    if context_split(cp):
        return cp.positions(seq * cp.size, hidden.device).unsqueeze(0)
    return torch.arange(seq, device=hidden.device).unsqueeze(0)


def vocab_embedding(config: PretrainedConfig, tp: TensorParallel | None) -> nn.Module:
    """(vocab, hidden) token embedding; split by vocabulary rows over a tensor-parallel group,
    whose output is then this rank's sequence slice under sequence parallelism."""
    if split(tp):
        return VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.group, tp.sequence_parallel
        )
    return nn.Embedding(config.vocab_size, config.hidden_size)


class TokenEmbedding(nn.Module):
    """Token ids (batch, seq) → hidden states, as `model.embed_tokens` of Llama-style models."""

    tied_weight_attr = "embed_tokens.weight"

    def __init__(
        self,
        config: PretrainedConfig,
        tp: TensorParallel | None = None,
        cp: ContextParallel | None = None,
        documents: Documents | None = None,
    ) -> None:
        super().__init__()  # (no positions here: `cp` and `documents` change nothing)
        self.init_std = config.initializer_range
        self.embed_tokens = vocab_embedding(config, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head: hidden @ embed_tokens.weight.T (this rank's vocabulary slice)."""
        return embedding_logits(self.embed_tokens, hidden)


def embedding_logits(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden @ the embedding's weight.T (this rank's vocabulary slice when it is split)."""
    if isinstance(embedding, VocabParallelEmbedding):
        return embedding.logits(hidden)
    return nn.functional.linear(hidden, embedding.weight)


def final_norm(norm_class: type[nn.Module], attr: str, eps_field: str) -> type[nn.Module]:
    """The norm after the last block: `norm_class(hidden, eps=config.<eps_field>)` stored as
    `attr` (its HF name), replicated over a tensor-parallel group."""

    class FinalNorm(nn.Module):
        def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
            super().__init__()
            self.init_std = config.initializer_range
            setattr(self, attr, norm_class(config.hidden_size, eps=getattr(config, eps_field)))
            if split(tp):
                tp.mark_replicated(self)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return getattr(self, attr)(hidden)

    FinalNorm.__qualname__ = FinalNorm.__name__ = f"{norm_class.__name__}Final"
    return FinalNorm


class LMHead(nn.Module):
    """Untied output projection hidden → vocab logits (`lm_head`); over a tensor-parallel group
    split by vocabulary, giving this rank's slice of the logits."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.init_std = config.initializer_range
        if split(tp):
            self.lm_head: nn.Module = VocabParallelHead(
                config.vocab_size, config.hidden_size, tp.group, tp.sequence_parallel, 1
            )
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tied_logits(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`TiedLayerSpec.forward_fn` of the head: logits from the shared embedding module."""
    return embedding.logits(hidden)


def rotary_block(
    layer_class: type[nn.Module], rotary_class: type[nn.Module], plan: TPPlan
) -> type[nn.Module]:
    """A pipeline layer subclassing `layer_class` (a `transformers` decoder layer called as
    ``(hidden_states, attention_mask, position_ids, position_embeddings)``) that computes its own
    rotary embedding with `rotary_class` from positions 0..seq-1, split over `tp` by `plan`.

    The rotary module holds only non-persistent buffers (nothing in the state dict), so each
    block owning one costs nothing and keeps the block self-contained for a stage; it is built
    on the CPU even when the block is built on the meta device, as its frequencies are computed
    in its constructor.
    """

    class Block(layer_class):  # type: ignore[valid-type, misc]
        def __init__(
            self,
            config: PretrainedConfig,
            layer_idx: int,
            tp: TensorParallel | None = None,
            cp: ContextParallel | None = None,
            documents: Documents | None = None,
        ) -> None:
            super().__init__(attention_config(config, cp), layer_idx)
            self.documents = documents
            self.init_std = config.initializer_range
            with torch.device("cpu"):
                self.rotary_emb = rotary_class(config)
            self.tp = tp if split(tp) else None
            self.cp = cp if context_split(cp) else None
            if self.tp is not None:
                parallelize(self, plan, self.tp)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            mask = None
            if active(self.documents):  # packed documents: their own positions and mask
                position_ids = self.documents.positions(hidden_states.device)
                mask = self.documents.mask(hidden_states.device)
            else:
                position_ids = sequence_positions(hidden_states, self.tp, self.cp)
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
            extra = {"context_parallel": self.cp} if self.cp is not None else {}
            return super().forward(
                hidden_states,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **extra,
            )

    Block.__qualname__ = Block.__name__ = layer_class.__name__.replace("DecoderLayer", "Block")
    return Block


ROTARY_TP_PLAN = TPPlan(
    enter=("self_attn", "mlp"),
    column={
        "self_attn.q_proj": 1,
        "self_attn.k_proj": 1,
        "self_attn.v_proj": 1,
        "mlp.gate_proj": 1,
        "mlp.up_proj": 1,
    },
    row=("self_attn.o_proj", "mlp.down_proj"),
)
"""Llama-style blocks: q, k, v, gate, up split by output features (whole heads: the head
counts must divide by tp), o and down by input features; one f entering attention and one
entering the MLP; their biases (Qwen2's q/k/v, `attention_bias`, `mlp_bias`) follow."""

MOE_TP_PLAN = TPPlan(
    enter=("self_attn",),
    column={"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1},
    row=("self_attn.o_proj",),
)
"""Mixture-of-experts blocks: attention split as in `ROTARY_TP_PLAN`; the MoE MLP (router,
experts, Qwen's shared expert) is replicated on every tensor-parallel rank. Under sequence
parallelism each rank routes and computes its own slice of the tokens (its gradients summed over
the group, like a norm's); without it every rank computes the whole MoE block for the same
tokens. Experts are split over ranks by expert parallelism (`parallel.ep`), not by tensor
parallelism."""

ROTARY_NAMES = HFNames(
    base="model.",
    blocks="model.layers.",
    embedding=("embed_tokens",),
    final_norm="norm",
    tied_attr=TokenEmbedding.tied_weight_attr,
)
"""`*ForCausalLM` of Llama-style models: model.embed_tokens, model.layers.<i>, model.norm,
lm_head."""


def rotary_family(
    name: str,
    architecture: str,
    config_class: type[PretrainedConfig],
    layer_class: type[nn.Module],
    norm_class: type[nn.Module],
    rotary_class: type[nn.Module],
    experts: ExpertFiles | None = None,
) -> Family:
    """A Llama-style family (`model_type` `name`): token embedding, `transformers`' decoder
    layer with its own rotary embedding, final RMSNorm `norm`, Megatron's column/row plan,
    HF names model.embed_tokens / model.layers / model.norm / lm_head, `rotary_checks`.
    With `experts` (how its files store them) the layer's MLP is a mixture of experts:
    `moe_checks`, and tensor parallelism splits attention only (`MOE_TP_PLAN`)."""
    plan = ROTARY_TP_PLAN if experts is None else MOE_TP_PLAN
    return Family(
        name=name,
        architectures=(architecture,),
        model_types=(name,),
        config_class=config_class,
        embedding=TokenEmbedding,
        block=rotary_block(layer_class, rotary_class, plan),
        final_norm=final_norm(norm_class, "norm", "rms_norm_eps"),
        tp_plan=plan,
        names=replace(ROTARY_NAMES, experts=experts),
        check=moe_checks if experts is not None else rotary_checks,
    )
