"""`export_hf`: the trained model out of every pipeline stage into one `transformers` directory,
streamed one tensor at a time to global rank 0, which writes it.

Memory. Gathering whole stages as Python objects (`gather_object`) pads every rank's pickle to
the largest and allocates max x world bytes on rank 0's GPU: for a 7B model in fp16 at dp=8
about 8 x 14 GB = 112 GB. Here no rank holds more than one layer at a time:

- every rank walks its layers in ascending global index; under ZeRO-3 each layer is gathered
  (over its data-parallel group) only while its tensors are sent, as the load does it;
- one replica holding each piece of a tensor sends it with `dist.send` from the engine's device;
  rank 0 receives it into a buffer on its device, moves it to the CPU, joins the pieces
  (`Shard.combine`) and writes the result straight to its place in the file
  (`StreamedSafetensors`): on rank 0 one tensor (plus its pieces) is alive at a time, on a
  sender one gathered layer.

The only object collective is one `all_gather_object` of the manifest (per parameter: name,
position, shape, dtype, shard; a few hundred bytes each, no tensor), after which every rank
knows the same plan: which rank sends which piece, in which order.

Ordering (NCCL). Sends and receives between a pair run in issue order and ZeRO-3's gathers are
collectives of each stage's data-parallel group. Every operation carries the key (global layer,
parameter position in it, shard rank); each rank issues its operations in ascending key, and a
layer's gather comes before its sends. The operation of smallest key not yet done then has
every participant at it, so it completes: no pair waits on each other.

Failure. When rank 0 cannot write (the target was taken meanwhile, the disk filled), it still
receives every piece (the senders would otherwise wait forever) and raises afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.engine.public import gathered_parameters
from dsnd.fs import umask
from dsnd.model.export_dir import ExportOrigin, replacing, write_whole
from dsnd.model.hf_files import file_shapes, split
from dsnd.model.hf_io import WEIGHTS, WEIGHTS_METADATA, copy_tokenizer, write_config
from dsnd.model.hf_weights import to_hf_names
from dsnd.model.safetensors_stream import Spec, StreamedSafetensors
from dsnd.model.source import ModelSpec
from dsnd.tp import Shard

Take = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one parameter, as the manifest lists it: the whole tensor
    (`shard` None) or one tensor- or expert-parallel shard of it."""

    name: str  # dsnd name
    order: tuple[int, int]  # (global layer index, the parameter's position in its layer)
    rank: int  # global rank holding it
    shape: tuple[int, ...]  # this piece's shape (before ZeRO-3 partitioning)
    dtype: torch.dtype
    shard: Shard | None

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.shard.full_shape(self.shape) if self.shard is not None else self.shape


Plan = dict[str, list[Piece]]  # dsnd name -> the pieces rank 0 joins, by shard rank


def stage_layers(stack: nn.Module) -> Iterator[tuple[int, str, nn.Module]]:
    """(global layer index, dsnd name prefix, module) of every module of the stage holding
    parameters, in ascending index (a tied module counts at its first layer)."""
    found = [
        (stack.tied_first_index[key], f"tied_modules.{key}.", m)
        for key, m in stack.tied_modules.items()
    ]
    found += [(int(index), f"layers.{index}.", m) for index, m in stack.layers.items()]
    for layer, prefix, module in sorted(found, key=lambda item: item[0]):
        if any(True for _ in module.parameters()):  # a borrowed tied weight holds none
            yield layer, prefix, module


def _replicas(param: nn.Parameter, data_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The ranks of a stage holding the same part of `param`: its data-parallel group, or for
    an expert parameter (`dsnd.moe`) its expert-data-parallel group."""
    experts = getattr(param, "expert_parallel", None)
    return experts.data if experts is not None else data_group


def offers(stack: nn.Module, data_group: dist.ProcessGroup) -> list[Piece]:
    """This rank's entries of the manifest: the pieces it holds as the first of its replicas."""
    rank, out = dist.get_rank(), []
    for layer, prefix, module in stage_layers(stack):
        for position, (name, param) in enumerate(module.named_parameters()):
            if dist.get_rank(_replicas(param, data_group)) == 0:
                out.append(
                    Piece(
                        prefix + name,
                        (layer, position),
                        rank,
                        unpartitioned_shape(param),
                        param.dtype,
                        getattr(param, "tp_shard", None),
                    )
                )
    return out


def make_plan(every: list[list[Piece]]) -> Plan:
    """Of every rank's offers, the sender of each piece (the lowest rank offering it: a whole
    tensor held on several tensor-parallel ranks is sent once), in the order of `Piece.order`."""
    chosen: dict[str, dict[int, Piece]] = {}
    for piece in sorted((p for ranks in every for p in ranks), key=lambda p: p.rank):
        chosen.setdefault(piece.name, {}).setdefault(piece.shard.rank if piece.shard else 0, piece)
    plan: Plan = {}
    for name, by_shard in sorted(
        chosen.items(), key=lambda item: min(p.order for p in item[1].values())
    ):
        pieces = [by_shard[r] for r in sorted(by_shard)]
        want = pieces[0].shard.size if pieces[0].shard is not None else 1
        if len(pieces) != want:
            raise ValueError(f"{name}: {len(pieces)} of its {want} shards are held by any rank")
        plan[name] = pieces
    return plan


def file_specs(plan: Plan, model: ModelSpec) -> dict[str, Spec]:
    """HF file tensor name -> (dtype, shape) of everything the plan writes (a tied weight under
    the embedding's name, experts one tensor each, as `write_hf_dir` writes them)."""
    specs: dict[str, Spec] = {}
    experts = model.family.names.experts
    for name, pieces in plan.items():
        hf_name = to_hf_names(name, model)[0]
        for file_name, shape in file_shapes(hf_name, pieces[0].full_shape, experts).items():
            if file_name in specs:
                raise ValueError(f"two dsnd tensors map to the HF name {file_name!r}")
            specs[file_name] = (pieces[0].dtype, tuple(shape))
    return specs


def _on(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    return param.detach().to(device).contiguous()


def _receive(
    pieces: list[Piece], params: dict[str, nn.Parameter], device: torch.device
) -> torch.Tensor:
    """Rank 0: the full tensor of `pieces` on the CPU, each piece received on `device` (or
    taken from this rank's own parameter) and moved to the CPU before the next."""
    parts = []
    for piece in pieces:
        if piece.rank == 0:
            value = params[piece.name].detach()
        else:
            value = torch.empty(piece.shape, dtype=piece.dtype, device=device)
            dist.recv(value, src=piece.rank)
        parts.append(value.to("cpu"))
    shard = pieces[0].shard
    return parts[0] if shard is None else shard.combine(parts).contiguous()


def stream(stack: nn.Module, plan: Plan, device: torch.device, take: Take) -> None:
    """Every rank: walk the layers of the plan and of this stage in ascending index; senders
    send their pieces, rank 0 hands each full tensor to `take` (after `take` raised once, it
    only receives, and raises that error at the end)."""
    rank, mine = dist.get_rank(), {layer: (prefix, m) for layer, prefix, m in stage_layers(stack)}
    by_layer: dict[int, list[tuple[str, list[Piece]]]] = {}
    for name, pieces in plan.items():
        by_layer.setdefault(min(p.order for p in pieces)[0], []).append((name, pieces))
    failed: Exception | None = None
    for layer in sorted(set(mine) | set(by_layer)):
        prefix, module = mine.get(layer, ("", None))
        params = {prefix + n: p for n, p in module.named_parameters()} if module else {}
        with gathered_parameters(list(params.values())) if params else nullcontext():
            for name, pieces in by_layer.get(layer, []):
                if rank != 0:
                    for piece in pieces:
                        if piece.rank == rank:
                            dist.send(_on(params[name], device), dst=0)
                    continue
                full = _receive(pieces, params, device)
                if failed is None:
                    try:
                        take(name, full)
                    except Exception as e:  # noqa: BLE001 (re-raised once every piece is in)
                        failed = e
    if failed is not None:
        raise failed


def _writer(out: StreamedSafetensors, model: ModelSpec) -> Take:
    experts = model.family.names.experts

    def take(name: str, full: torch.Tensor) -> None:
        for file_name, part in split(to_hf_names(name, model)[0], full, experts).items():
            out.write(file_name, part)

    return take


def _discard(name: str, full: torch.Tensor) -> None:
    """What rank 0 does with the tensors of an export it cannot write: receive, drop."""


class _Once:
    """Rank 0's one pass over the plan: run with a writer, or (`drain`), when the export failed
    before it began, with nothing to write to, so that every send is received either way."""

    def __init__(self, stack: nn.Module, plan: Plan, device: torch.device) -> None:
        self.stack, self.plan, self.device, self.begun = stack, plan, device, False

    def run(self, take: Take) -> None:
        self.begun = True
        stream(self.stack, self.plan, self.device, take)

    def drain(self) -> None:
        if not self.begun:
            self.run(_discard)


def _write_dir(tmp: str, model: ModelSpec, once: _Once) -> None:
    """Rank 0: fill the export's temporary directory while the tensors stream in."""
    specs = file_specs(once.plan, model)
    weights = os.path.join(tmp, WEIGHTS)
    with StreamedSafetensors(weights, specs, WEIGHTS_METADATA) as out:
        once.run(_writer(out, model))
    os.chmod(weights, 0o666 & ~umask())
    # the dtype the tensors are written in (a bf16 model directory trained in fp32 exports fp32)
    write_config(tmp, model, next(iter(once.plan.values()))[0].dtype)
    copy_tokenizer(tmp, model.directory)


def export_hf(
    stack: nn.Module,
    path: str,
    model: ModelSpec,
    data_group: dist.ProcessGroup,
    origin: ExportOrigin,
    device: torch.device,
) -> str | None:
    """Write the full model (every stage's parameters) as an HF directory at `path` (rank 0,
    through `write_whole`, as `write_hf_dir` writes it); on rank 0 returns the line saying
    where it went, None elsewhere. Tensors travel on `device` (the engine's).

    Collective over the world: every rank must call it.
    """
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, offers(stack, data_group))
    plan = make_plan(every)
    if dist.get_rank() != 0:
        stream(stack, plan, device, _discard)
        return None
    once = _Once(stack, plan, device)
    try:
        earlier = write_whole(
            path, origin, lambda tmp: _write_dir(tmp, model, once), f"checkpoint.export_hf={path}"
        )
    except Exception:
        once.drain()  # refused before any receive (target taken meanwhile): take them anyway
        raise
    return (
        f"exported step {origin.step} as a transformers directory ({len(plan)} tensors) "
        f"to {path}{replacing(earlier)}"
    )
