"""The rules about parallel degrees alone, checked whenever a `dsnd.topology.Topology` is built:
the degrees carved out of the data axis (ep, dp_shard, hpz) must divide it, and the ones that
choose ZeRO's groups in different ways must not meet. A rule that hpZ's size (from the
DeepSpeed JSON) breaks begins with `hpz_from`, the JSON or the ``--set`` it came from, as every
DeepSpeed-key error does. Rules that also need the model (ep must
divide its experts) or the DeepSpeed JSON (hybrid sharding needs ZeRO-3) are the config's
(`dsnd.config.resolve`). Pure: no torch here.
"""

from __future__ import annotations

from typing import Any

from dsnd.errors import UserError


def check_degrees(t: Any) -> None:
    """Refuse a `Topology` whose degrees do not compose (`t` duck-typed: this module sits below
    the one it checks)."""
    if t.ep < 1:
        raise UserError(f"parallel.ep={t.ep} must be >= 1")
    if t.dp % t.ep:
        raise UserError(
            f"parallel.ep={t.ep} must divide the data-parallel size dp={t.dp} "
            "(world / (pp * tp * cp))"
        )
    _check_dp_shard(t)
    if t.hpz > 1 and t.dp % min(t.hpz, t.dp):
        raise UserError(
            f"{t.hpz_from}: zero_optimization.zero_hpz_partition_size={t.hpz} must "
            f"divide each stage's data-parallel size dp={t.dp}"
        )
    if t.ep > 1 and t.hpz > 1:
        raise UserError(
            f"{t.hpz_from}: zero_optimization.zero_hpz_partition_size={t.hpz} with "
            f"parallel.ep={t.ep} is not supported: hpZ's secondary partition is cut "
            "from all data-parallel ranks, the experts' from the ranks holding the "
            "same experts; set one of them"
        )


def _check_dp_shard(t: Any) -> None:
    """Hybrid sharding (`parallel.dp_shard`): runs of dp_shard ranks of the data axis."""
    size = t.dp_shard
    if size == 0:
        return
    if size < 0 or t.dp % size:
        raise UserError(
            f"parallel.dp_shard={size} must divide the data-parallel size dp={t.dp} "
            "(or be null or 0: shard over all of dp)"
        )
    if t.hpz > 1:
        raise UserError(
            f"{t.hpz_from}: zero_optimization.zero_hpz_partition_size={t.hpz} and "
            f"parallel.dp_shard={size} both choose where ZeRO-3 gathers parameters "
            "from; set one of them"
        )
    if t.cp > 1:
        raise UserError(
            f"parallel.dp_shard={size} with parallel.cp={t.cp} is not supported: "
            "hybrid sharding runs without context parallelism"
        )
    if t.ep > 1:
        raise UserError(
            f"parallel.ep={t.ep} with parallel.dp_shard={size} is not supported: the "
            "experts are sharded over the ranks holding the same experts, hybrid "
            "sharding would cut those groups again; set one of them"
        )
