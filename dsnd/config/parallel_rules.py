"""The run's parallel settings held against the model and the DeepSpeed JSON, before any process
starts: what tensor, context and expert parallelism need of the model, what the MoE settings
need, and what the degrees need of ZeRO. (How the degrees compose with each other is the
topology's own rule: `dsnd.topology_rules`.)"""

from __future__ import annotations

from typing import Any

from dsnd.config.schema import ParallelConfig, RunConfig
from dsnd.cp.slices import IMPLS, divisor
from dsnd.errors import UserError
from dsnd.model.moe_config import expert_layers, num_experts
from dsnd.model.source import ModelSpec
from dsnd.moe.router_aux import wants_router_aux
from dsnd.topology import Topology


def zero_stage(ds: dict[str, Any]) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def check_tp(model: ModelSpec, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Megatron splits heads and the MLP width across tp ranks, and with sequence parallelism
    the sequence: every count must divide. (The vocabulary is padded.) Mixture-of-experts MLPs
    are not split (`dsnd.model.decoder.MOE_TP_PLAN`), so their width need not divide."""
    counts = [("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)]
    if not model.family.moe:
        counts.append(("ffn_size", model.ffn_size))
    for name, value in counts:
        if value % tp:
            raise UserError(f"{model.source}: {name}={value} is not divisible by parallel.tp={tp}")
    if sequence_parallel and tp > 1 and seq_len % tp:
        raise UserError(
            f"parallel.sequence_parallel: model.seq_len={seq_len} is not divisible by "
            f"parallel.tp={tp}"
        )


def check_cp(model: ModelSpec, par: ParallelConfig, seq_len: int) -> None:
    """Context parallelism cuts each sequence into cp slices (ring: 2*cp chunks), which
    sequence parallelism cuts again into tp; Ulysses hands each rank whole sequences of
    heads/cp of its tensor-parallel heads, query and key/value heads alike."""
    cp, impl, tp = par.cp, par.cp_impl, par.tp
    if impl not in IMPLS:
        raise UserError(f"parallel.cp_impl={impl!r}: expected one of {', '.join(IMPLS)}")
    if cp == 1:
        return
    parts = divisor(cp, impl) * (tp if par.sequence_parallel and tp > 1 else 1)
    if seq_len % parts:
        how = f"2 * parallel.cp = {2 * cp}" if impl == "ring" else f"parallel.cp = {cp}"
        if parts != divisor(cp, impl):
            how += f" times parallel.tp = {tp} (sequence parallelism)"
        raise UserError(
            f"parallel.cp={cp} ({impl}): model.seq_len={seq_len} is not divisible by {how}"
        )
    if impl == "ulysses":
        for name, heads in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
            if (heads // tp) % cp:
                raise UserError(
                    f"parallel.cp_impl=ulysses: {model.source}: {name}={heads} gives "
                    f"{heads // tp} heads per tensor-parallel rank, not divisible by "
                    f"parallel.cp={cp} (use cp_impl: ring, which splits the sequence only)"
                )


def check_ep(model: ModelSpec, ep: int) -> None:
    """Expert parallelism splits each MoE layer's experts over `parallel.ep` data-parallel
    ranks: the model needs experts, and ep must divide them (that it divides dp, and meets no
    other degree that regroups ZeRO, is the topology's rule: `dsnd.topology_rules`)."""
    if ep <= 1:
        return
    if not model.family.moe:
        raise UserError(
            f"parallel.ep={ep}: {model.source} is a dense model "
            f"({model.family.name}), with no experts to split; use parallel.ep=1"
        )
    if not expert_layers(model.config):
        config = model.config
        raise UserError(
            f"parallel.ep={ep}: {model.source} has no layer with experts "
            f"(decoder_sparse_step={getattr(config, 'decoder_sparse_step', None)}, "
            f"mlp_only_layers={getattr(config, 'mlp_only_layers', None)} of "
            f"{config.num_hidden_layers} layers: every layer is dense); use "
            "parallel.ep=1"
        )
    experts = num_experts(model.config)
    if experts % ep:
        raise UserError(
            f"parallel.ep={ep} must divide the {experts} experts per layer of {model.source}"
        )


def check_router_aux(model: ModelSpec, par: ParallelConfig) -> None:
    """`output_router_logits: true` adds the routers' load-balancing loss, which pools every
    MoE layer's routing over all tokens of a forward (`dsnd.moe.router_aux`); context
    parallelism would give each rank a slice of every sequence, with its own loss scaling."""
    if model.family.moe and wants_router_aux(model.config) and par.cp > 1:
        raise UserError(
            f"{model.source}: output_router_logits=true (the routers' load-balancing loss, "
            f"router_aux_loss_coef={model.config.router_aux_loss_coef}) is not computed with "
            f"parallel.cp={par.cp}; use parallel.cp=1 (sequence parallelism works), or set it "
            "to false (--set model.overrides.output_router_logits=false)"
        )


def check_capacity(run: RunConfig, model: ModelSpec) -> None:
    """`model.moe_capacity_factor` caps each expert's rows of a rank's forward
    (`dsnd.moe.capacity`): a mixture of experts with every token of a sequence on the rank."""
    factor, par = run.model.moe_capacity_factor, run.parallel
    if factor is None:
        return
    if not model.family.moe:
        raise UserError(
            f"model.moe_capacity_factor={factor}: {model.source} is a dense model "
            f"({model.family.name}), with no experts; set it to null"
        )
    if not factor > 0:
        raise UserError(f"model.moe_capacity_factor={factor} must be > 0 (null = dropless)")
    experts, top_k = num_experts(model.config), model.config.num_experts_per_tok
    if not factor <= experts / top_k:  # past it the capacity only grows (1e300: an overflow)
        raise UserError(
            f"model.moe_capacity_factor={factor} must be in (0, {experts / top_k:g}] "
            f"for {model.source} ({experts} experts, top-{top_k}): at "
            f"{experts / top_k:g} an expert may take every token of a forward and "
            "nothing is dropped (null = dropless)"
        )
    if par.cp > 1 or (par.sequence_parallel and par.tp > 1):
        key = f"parallel.cp={par.cp}" if par.cp > 1 else "parallel.sequence_parallel=true"
        raise UserError(
            f"model.moe_capacity_factor={factor}: not with {key}, which gives each "
            "rank a slice of every sequence (the capacity counts a rank's whole "
            "micro-batch)"
        )


def check_zero_degrees(topology: Topology, ds: dict[str, Any], ds_path: str) -> None:
    """What the degrees need of the DeepSpeed JSON's ZeRO (how the degrees compose is the
    topology's: `dsnd.topology_rules`).

    Hybrid sharding (`parallel.dp_shard`, `dsnd.engine.hsdp`) is ZeRO-3 over groups of dp_shard
    data-parallel ranks, replicated across them. With `parallel.ep` > 1 ZeRO keeps the experts
    in groups of their own, sharded over the ranks holding the same experts
    (`dsnd.engine.experts`). DeepSpeed's ZeRO 1-2 do that only with reduce-scatter and
    contiguous gradients: without them ZeRO-2 asserts, and ZeRO-1 warns "experimental" and
    trains wrong (observed, not in the suite: Mixtral-tiny dp=4 ep=2, loss 5.5017 at step 2
    where one process has 5.4989; `tests/unit/test_ep_config.py` checks the refusals)."""
    zero, stage = ds.get("zero_optimization") or {}, zero_stage(ds)
    if topology.dp_shard and stage != 3:
        raise UserError(
            f"parallel.dp_shard={topology.dp_shard} needs ZeRO stage 3 (shards "
            f"parameters within groups of {topology.dp_shard} ranks); {ds_path} sets "
            f"zero_optimization.stage={stage}"
        )
    if topology.ep == 1 or stage not in (1, 2):
        return
    where = f"parallel.ep={topology.ep} at ZeRO stage {stage} ({ds_path})"
    if zero.get("reduce_scatter") is False:
        raise UserError(
            f"{where} needs zero_optimization.reduce_scatter=true (DeepSpeed reduces "
            "expert gradients over their own ranks only with it); it is false"
        )
    if zero.get("contiguous_gradients") is False:
        raise UserError(
            f"{where} needs zero_optimization.contiguous_gradients=true (DeepSpeed's "
            "ZeRO 1-2 keep expert gradients apart only with it); it is false"
        )


def check_reshard(par: Any, ds: dict[str, Any], ds_path: str) -> None:
    """`parallel.reshard_after_forward: false` keeps ZeRO-3's gathered parameters: only ZeRO-3
    partitions parameters at all."""
    if not par.reshard_after_forward and zero_stage(ds) != 3:
        raise UserError(
            f"parallel.reshard_after_forward=false needs ZeRO stage 3 (only it "
            f"partitions parameters); {ds_path} sets zero_optimization.stage="
            f"{zero_stage(ds)}"
        )
