"""Count the collectives and point-to-point messages this process issues: op, bytes, group.

`count_comm()` is a context manager yielding a `CommCounter` whose `calls` list gets one `Call`
per collective issued inside it, by dsnd (torch.distributed directly: tensor parallelism, the
pipeline's messages) and by DeepSpeed (through `deepspeed.comm`) alike; on exit nothing is
left installed.

Where it counts: at the c10d operators of torch's dispatcher (``torch.ops.c10d.allreduce_``,
``_allgather_base_``, ``_reduce_scatter_base_``, ``send``, ...), which every
``torch.distributed`` function calls, as a `TorchDispatchMode`. Wrapping the
``torch.distributed`` functions themselves would miss calls: DeepSpeed 0.19.8's comm backend
(`deepspeed.comm.torch.TorchBackend`) looks ``all_gather_into_tensor`` (or
``_all_gather_base``) and ``reduce_scatter_tensor`` up once, when ``deepspeed.init_distributed``
runs, and calls the stored functions for ZeRO-3's parameter gathers and gradient scatters ever
after. torch's own `CommDebugMode` sees the same operators but keeps only a count per operator,
no bytes and no group, which is why this mode is written here.

Bytes. A call's `payload` is the collective's whole logical tensor S: the all-reduced tensor,
the all-gather's output, the reduce-scatter's input, the broadcast or reduced tensor, the
all-to-all's input, a message sent or received. `sent` is what one rank of a group of n sends
for it with the bandwidth-optimal ring (or chain) algorithm, averaged over the group's ranks:
all-reduce 2(n-1)/n S; all-gather, reduce-scatter, reduce, broadcast, all-to-all (n-1)/n S; a
send S, a receive 0. A data-parallel all-reduce of Psi gradient bytes thus sends 2(n-1)/n Psi
per rank, ZeRO's reduce-scatter plus all-gather the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_": "reduce",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
"""The c10d operators counted (by their name in ``torch.ops.c10d``) and the op each counts as.
Barriers, gather and scatter to one root are not counted."""

PAYLOAD_ARG = {
    "all_reduce": "tensors",
    "reduce": "tensors",
    "broadcast": "tensors",
    "send": "tensors",
    "recv": "tensors",
    "all_to_all": ("input", "input_tensors"),
}
"""Which argument holds the payload S of each op (all-gather: its outputs; reduce-scatter: its
inputs; see `_payload`)."""


@dataclass(frozen=True)
class Call:
    """One collective this rank took part in."""

    op: str  # all_reduce, all_gather, reduce_scatter, reduce, broadcast, all_to_all, send, recv
    payload: int  # bytes of the collective's whole logical tensor (module docstring)
    group_size: int
    ranks: tuple[int, ...]  # the group's global ranks
    group: str  # the process group's name: tells two groups of the same ranks apart
    label: str = ""  # the counter's label when the call was issued

    @property
    def sent(self) -> float:
        """Bytes this rank sends for it under the ring algorithm, averaged over the group."""
        return sent_bytes(self.op, self.payload, self.group_size)


def sent_bytes(op: str, payload: float, group_size: int) -> float:
    """Per-rank bytes sent for `op` of `payload` bytes in a group of `group_size` (ring)."""
    n = group_size
    if op == "send":
        return float(payload)
    if op == "recv" or n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return factor * payload


def _bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


def _payload(op: str, kwargs: dict) -> int:
    if op == "all_gather":
        key = next(
            k for k in ("output_tensor", "output_tensors", "outputs", "output_lists") if k in kwargs
        )
    elif op == "reduce_scatter":
        key = next(k for k in ("input_tensor", "input_tensors", "inputs") if k in kwargs)
    else:
        names = PAYLOAD_ARG[op]
        key = names if isinstance(names, str) else next(k for k in names if k in kwargs)
    return _bytes(kwargs[key])


class CommCounter(TorchDispatchMode):
    """The dispatch mode of `count_comm`: appends a `Call` per counted operator to `calls`,
    labelled with `label` (set it to tell a step's phases apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.label = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = OPS.get(func._opname) if func.namespace == "c10d" else None
        if op is not None:
            self.calls.append(self._call(op, func, args, kwargs))
        return func(*args, **kwargs)

    def _call(self, op: str, func, args: Sequence, kwargs: dict) -> Call:
        named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)}
        named.update(kwargs)
        group = dist.ProcessGroup.unbox(named["process_group"])
        ranks = tuple(dist.get_process_group_ranks(group))
        return Call(op, _payload(op, named), len(ranks), ranks, group.group_name, self.label)


def summarize(calls: Sequence[Call], groups: Mapping[str, Sequence[int]]) -> list[dict[str, Any]]:
    """`calls` summed per (kind, label, op): one dict each with its number of calls, payload
    and sent bytes (in first-seen order). A call's kind is the first name in `groups` whose
    ranks are the call's group's (e.g. {"dp": ..., "pp": ..., "tp": ...}), else "other"."""
    by_ranks = {}
    for kind, ranks in groups.items():
        by_ranks.setdefault(tuple(ranks), kind)
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in calls:
        kind = by_ranks.get(c.ranks, "other")
        row = out.setdefault(
            (kind, c.label, c.op),
            {"kind": kind, "label": c.label, "op": c.op, "calls": 0, "payload": 0, "sent": 0.0},
        )
        row["calls"] += 1
        row["payload"] += c.payload
        row["sent"] += c.sent
    return list(out.values())


@contextlib.contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count every collective issued inside the block (this thread, and autograd's backward
    it starts); the yielded counter's `calls` holds them."""
    with CommCounter() as counter:
        yield counter
