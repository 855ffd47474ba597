"""Record every communication call of this process: what, on which group, with whom, which were
launched together, and which the host waited on before going on.

Installed in a rank process by `tests.distributed.worker.world` when ``DSND_NCCL_TRACE`` names a
folder (`tests.procs.run_ranks` sets it); the record is written to ``rank_<R>.json`` there when
the process group goes away.

Where it records: the methods of torch's `ProcessGroup` (``allreduce``, ``send``, ``recv``, ...)
and `Work.wait`, patched on the classes. Every `torch.distributed` function ends in one of those
methods, and so do DeepSpeed's calls (`deepspeed.comm` stores torch's functions, which call
them), so nothing escapes, whoever holds a reference to which function. A blocking call is a
method call and a `wait()`; `batch_isend_irecv` marks the operations it issues as one batch (on
NCCL they are launched together between ``ncclGroupStart`` and ``ncclGroupEnd``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, Work

ENV = "DSND_NCCL_TRACE"
HERE = "/" + os.path.abspath(__file__).replace(os.sep, "/").lstrip("/")

P2P = {"send": "send", "recv": "recv", "recv_anysource": "recv_any"}
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "reduce",
    "broadcast",
    "alltoall",
    "alltoall_base",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _where() -> str:
    """file:line of the nearest caller in dsnd or the tests (else DeepSpeed), past this file."""
    frame, fallback = sys._getframe(2), ""
    while frame is not None:
        name = frame.f_code.co_filename
        path = "/" + os.path.abspath(name).replace(os.sep, "/").lstrip("/")
        if path != HERE:
            here = f"{os.path.basename(name)}:{frame.f_lineno}"
            if "/dsnd/" in path or "/tests/" in path:
                return here
            if not fallback and "/deepspeed/" in path:
                fallback = here
        frame = frame.f_back
    return fallback


class Recorder:
    """This process's record: `events` in issue order, `groups` by name -> global ranks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[list] = []  # ["op", id, name, group, peer, bytes, dtype, batch, where]
        self.groups: dict[str, list[int]] = {}  # or ["wait", id]
        # id(work) -> op id. Not holding the works (gloo's hold their tensors): a live work's
        # id is its own, and a new work of a dead one's id registers before anyone waits on it
        self.works: dict[int, int] = {}
        self.batch: int | None = None
        self.batches = 0
        self.ops = 0
        self._saved: list[tuple[type, str, Any]] = []

    def _group(self, pg: ProcessGroup) -> tuple[str, list[int]]:
        name = pg.group_name
        if name not in self.groups:
            self.groups[name] = dist.get_process_group_ranks(pg)
        return name, self.groups[name]

    def op(self, pg: ProcessGroup, name: str, args: tuple, work: Any) -> None:
        group, ranks = self._group(pg)
        tensors = _tensors(args[:1]) if name in P2P else _tensors(args[:2])
        peer = ranks[args[1]] if name in ("send", "recv") else -1
        payload = sum(t.numel() * t.element_size() for t in _tensors(args[:1]))
        dtype = str(tensors[0].dtype) if tensors else ""
        op_id = self.ops
        self.ops += 1
        self.events.append(
            ["op", op_id, P2P.get(name, name), group, peer, payload, dtype, self.batch, _where()]
        )
        if isinstance(work, Work):
            self.works[id(work)] = op_id

    def wait(self, work: Work) -> None:
        op_id = self.works.pop(id(work), None)
        if op_id is not None:
            self.events.append(["wait", op_id])

    def install(self) -> None:
        """Patch the classes (undone by `uninstall`)."""
        recorder = self

        def patch(cls: type, name: str, make) -> None:
            original = getattr(cls, name)
            self._saved.append((cls, name, original))
            setattr(cls, name, make(original))

        def method(name: str):
            def make(original):
                def call(pg, *args, **kwargs):
                    work = original(pg, *args, **kwargs)
                    recorder.op(pg, name, args, work)
                    return work

                return call

            return make

        for name in (*P2P, *COLLECTIVES):
            if hasattr(ProcessGroup, name):
                patch(ProcessGroup, name, method(name))

        def make_wait(original):
            def wait(work, *args, **kwargs):
                out = original(work, *args, **kwargs)
                recorder.wait(work)  # after: the host went on only once it was done
                return out

            return wait

        patch(Work, "wait", make_wait)

        import torch.distributed.distributed_c10d as c10d

        def make_batch(original):
            def batch_isend_irecv(p2p_op_list):
                recorder.batch, recorder.batches = recorder.batches, recorder.batches + 1
                try:
                    return original(p2p_op_list)
                finally:
                    recorder.batch = None

            return batch_isend_irecv

        patch(c10d, "batch_isend_irecv", make_batch)
        dist.batch_isend_irecv = c10d.batch_isend_irecv
        self._saved.append((dist, "batch_isend_irecv", self._saved[-1][2]))

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def write(self, folder: str) -> None:
        path = os.path.join(folder, f"rank_{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": self.rank, "groups": self.groups, "events": self.events}, f)
        os.replace(path + ".tmp", path)


def start(rank: int) -> Recorder | None:
    """A recorder installed in this process when ``DSND_NCCL_TRACE`` is set, else None."""
    if not os.environ.get(ENV):
        return None
    recorder = Recorder(rank)
    recorder.install()
    return recorder


def finish(recorder: Recorder | None) -> None:
    if recorder is not None:
        recorder.uninstall()
        recorder.write(os.environ[ENV])
