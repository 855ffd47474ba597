"""What a model family is, as data: its layers, tensor-parallel plan, HF names and config checks.

A family (one file under `dsnd.model.families`) fills one `Family`. The rest of dsnd reads these
fields and never asks which family it has: pipeline layer specs (`dsnd.model.stack`), tensor
parallelism (`dsnd.model.parallelize`), HF import/export (`dsnd.model.hf_weights`), parameter
counts and FLOPs (built on the meta device), checkpoints (keyed by the names the layers have).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig


@dataclass(frozen=True)
class TPPlan:
    """Megatron's column/row pattern over a block's submodules (paths relative to the block).

    Inside a block, `enter` modules are where a tensor-parallel region starts: their input goes
    through f (identity forward, all-reduce of the gradient backward; with sequence parallelism
    the all-gather of the sequence slices), once per region however many column layers read it.
    `column` layers (nn.Linear or Conv1D) are split by output features, so each rank computes its
    heads / its slice of the MLP width; a fused weight (GPT-2's q|k|v) names its stride, the
    number of equal parts split separately. `row` layers are split by input features; their
    partial sums leave the region through g (all-reduce; reduce-scatter under sequence
    parallelism) and their bias, replicated, is added once after it. `divide` names integer
    attributes of submodules that count this rank's share (GPT-2's `attn.split_size`).
    Every other parameter is replicated; those used inside a region see only this rank's heads
    (Qwen3's q/k norms) and get their gradient summed over the group.
    """

    enter: tuple[str, ...]
    column: dict[str, int]  # module path -> stride
    row: tuple[str, ...]
    divide: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertFiles:
    """How `transformers`' checkpoint files store a mixture-of-experts block: one 2-D weight
    per expert (what `save_pretrained` writes and published checkpoints hold), where the model
    in memory keeps each layer's experts as two 3-D tensors, `mlp.experts.gate_up_proj` (E, 2I,
    H) = per expert [gate; up], and `mlp.experts.down_proj` (E, H, I); see `dsnd.model.hf_files`.
    """

    block: str  # the MoE block's name in files: "block_sparse_moe" (Mixtral) or "mlp"
    gate: str  # per-expert projection names in files: w1 / gate_proj
    up: str  # w3 / up_proj
    down: str  # w2 / down_proj


@dataclass(frozen=True)
class HFNames:
    """Where a `*ForCausalLM` state dict keeps each dsnd layer (see `dsnd.model.hf_weights`)."""

    base: str  # "model." / "transformer."
    blocks: str  # "model.layers." / "transformer.h."
    embedding: tuple[str, ...]  # first name part of the embedding's parameters
    final_norm: str  # first name part of the final norm's parameters
    tied_attr: str  # the embedding's parameter the head shares when tied
    ignored: str = r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$"  # recomputed buffers
    experts: ExpertFiles | None = None  # a mixture-of-experts family's per-expert file names


@dataclass(frozen=True)
class Family:
    """One architecture. The layer classes are called as `embedding(config, tp, cp, documents)`,
    `block(config, layer_idx, tp, cp, documents)`, `final_norm(config, tp)`; `tp` and `cp` (the
    context-parallel group) are None for a single rank, `documents` (`dsnd.model.documents`)
    None unless packed documents are kept apart.
    `check(config, seq_len)` returns one line per config value dsnd cannot honour.
    A mixture-of-experts family (`moe`) names its per-expert files (`names.experts`)."""

    name: str
    architectures: tuple[str, ...]  # `architectures` entries of config.json it serves
    model_types: tuple[str, ...]  # config.model_type values
    config_class: type[PretrainedConfig]
    embedding: Callable[..., nn.Module]
    block: Callable[..., nn.Module]
    final_norm: Callable[..., nn.Module]
    tp_plan: TPPlan
    names: HFNames
    check: Callable[[PretrainedConfig, int], list[str]]

    @property
    def moe(self) -> bool:
        """Whether blocks route each token to `num_experts_per_tok` of `num_experts` experts."""
        return self.names.experts is not None
