"""Bytes per device of a layout: model states, activations, buffers.

- Model states: the ZeRO paper's accounting (`dsnd.plan.memory.model_state_bytes`, the formula
  `dsnd ds-config explain` prints and `dsnd bench zero-memory` checks against DeepSpeed): in
  bf16 with Adam, 2 + 2 + K = 12 bytes per parameter (fp32 master and two moments), split over
  the data-parallel (x context-parallel) ranks by the ZeRO stage. "optimizer" here is the
  master and the moments together, the paper's K.
- Activations per block and micro-batch, counted op by op (`block_activation_bytes`); a stage
  holds as many micro-batch chunks as its schedule keeps in flight (`dsnd.plan.schedule`).
  For Megatron's GPT layer the count reproduces Korthikanti et al.'s closed forms
  (`korthikanti_bytes`).
- Buffers: what DeepSpeed allocates besides (ZeRO-3's gathered layers, gradient buckets).
"""

from __future__ import annotations

import math

from dsnd.layout_search.shape import ModelShape
from dsnd.plan.memory import model_state_bytes

RECOMPUTE = ("none", "selective", "full")
STATS_BYTES = 4  # norm statistics and attention log-sum-exps stay fp32


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Activation bytes per transformer layer (fp16, dropout on), Korthikanti et al. 2022
    Table 2: sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism; sbh/t (34 + 5as/h) with sequence parallelism too; selective recomputation drops
    the 5as/h terms; full recomputation keeps 2sbh."""
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def block_activation_bytes(
    shape: ModelShape, b: int, s: int, t: int, cp: int, sp: bool, recompute: str, dtype_bytes: int
) -> float:
    """Bytes one block saves for backward for one micro-batch of `b` sequences of `s` tokens, on
    one rank of `t` tensor- and `cp` context-parallel ranks."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    tokens = b * s / cp
    rep = t if sp else 1  # what the tensor-parallel region does not split, SP does
    if recompute == "full":  # the block's input (sequence-parallel: its shard)
        return tokens * shape.hidden * dtype_bytes / rep
    if shape.megatron_layer:
        return _megatron_layer(tokens, s, shape, t, rep, recompute)
    q, kv = shape.heads * shape.head_dim / t, shape.kv_heads * shape.head_dim / t
    h, f = shape.hidden, shape.ffn / t
    # dsnd's blocks, as saved_tensors_hooks list them (no dropout; fused attention keeps its
    # output and log-sum-exp, not the scores): per norm its input, output and the linear's
    # input (RMSNorm: 3h + 1 statistic; LayerNorm keeps 2 statistics and 2h) ...
    if recompute == "selective":
        raise ValueError(
            "dsnd's blocks recompute whole (activation checkpointing), not selectively"
        )
    norms = 2 * (3 * h if shape.rms_norm else 2 * h)
    stats = 2 * (1 if shape.rms_norm else 2) + shape.heads / t
    # ... q, k, v (after RoPE), the attention output, and the MLP's intermediates.
    attention = 2 * q + 2 * kv
    mlp = shape.mlp_saved * f
    elements = norms / rep + attention + mlp
    extra = 0.0
    if shape.moe:  # (never tensor-parallel) each of a token's k rows gathered for its expert
        # and the expert's output; the router's probabilities (fp32) and top-k weights; the
        # routing's int64 indices (top-k ids, the sort's order and its inverse, the gather)
        k = shape.top_k
        elements += 2 * k * h
        stats += shape.experts + 2 * k + 1
        extra = 4 * k * 8
    return tokens * (elements * dtype_bytes + stats * STATS_BYTES + extra)


def _megatron_layer(
    tokens: float, s: int, shape: ModelShape, t: int, rep: int, recompute: str
) -> float:
    """Megatron's GPT layer in fp16, op by op (2 bytes per element, 1 per dropout mask)."""
    sbh = tokens * shape.hidden
    replicated = (2 + 1 + 2 + 1 + 2 + 2) * sbh  # LN input, attention and MLP dropout masks,
    # the QKV and MLP-input copies of the LN outputs, and the second LN's input
    split = (4 + 2 + 2 + 8 + 8) * sbh  # Q and K, V, output projection input, GELU in, fc2 in
    scores = 0.0
    if recompute == "none":  # softmax output (2), its dropout mask (1) and output (2)
        scores = 5.0 * shape.heads * s * tokens
    return replicated / rep + (split + scores) / t


def head_activation_bytes(shape: ModelShape, tokens: float, t: int, dtype_bytes: int) -> float:
    """The final norm and the logits the loss keeps: the logits in the compute dtype and their
    fp32 log-softmax (vocabulary split over the tensor-parallel ranks)."""
    return tokens * (3 * shape.hidden * dtype_bytes + shape.vocab / t * (dtype_bytes + 4))


def states(
    stage: int, psi: float, nd: int, bf16: bool, experts: float = 0, ep: int = 1
) -> dict[str, float]:
    """params / grads / optimizer (fp32 master + Adam's moments) bytes per device; `experts`
    of the `psi` parameters routed experts split over `ep` ranks (a rank holds experts / ep,
    sharded over nd / ep)."""
    parts = model_state_bytes(stage, int(psi), nd, bf16, experts=int(experts), ep=ep)["device"]
    return {
        "params": parts["params"],
        "grads": parts["grads"],
        "optimizer": parts["master"] + parts["optimizer"],
    }


def buffers(stage: int, largest_layer: float, bucket: float, bf16: bool) -> float:
    """ZeRO-3: a gathered layer and the one prefetched behind it, plus the gradient bucket;
    ZeRO 1-2: the gradient bucket (`reduce_bucket_size` elements); ZeRO-0 none."""
    low = 2 if bf16 else 4
    if stage == 0:
        return 0.0
    gathered = 2 * largest_layer * low if stage == 3 else 0.0
    return gathered + bucket * low


def nodes(ranks: int, per_node: int) -> tuple[int, int]:
    """(devices per node, nodes) of `ranks` devices filled node by node."""
    return min(ranks, per_node), math.ceil(ranks / per_node)
