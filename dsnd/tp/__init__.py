"""Megatron-style tensor parallelism: f/g mappings, parallel layers, vocab loss, RNG.

Megatron-style tensor parallelism: f/g mappings, parallel layers, vocab-parallel loss, and the
replicated / tensor-parallel RNG streams (`TPRandomState`).

Every function and layer takes its tensor-parallel process group as an argument.
"""

from dsnd.tp.cross_entropy import vocab_parallel_cross_entropy
from dsnd.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    allreduce_partial_grads,
    enter_tp,
    leave_tp,
    load_full,
    mark_split,
)
from dsnd.tp.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from dsnd.tp.random import TPRandomState
from dsnd.tp.shard import Shard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Shard",
    "TPRandomState",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "allreduce_partial_grads",
    "copy_to_tp",
    "enter_tp",
    "gather_from_sp",
    "gather_from_tp",
    "leave_tp",
    "load_full",
    "mark_split",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
]
