"""Replay every rank's record (`tests.nccl_rules.record`) under NCCL's semantics and report
each operation that could never complete, and each message whose two ends disagree.

The rules (torch 2.13's ProcessGroupNCCL):

- Each rank runs its operations on CUDA streams, one per NCCL communicator it uses; a stream
  runs its operations one after another, in issue order.
- Which communicator: a group's collectives use the group's communicator. A point-to-point
  operation uses, in the *lazy* mode (the default), a two-rank communicator of its pair of ranks
  (one per group and pair, both directions on it) when issued alone, and the group's
  communicator when issued in a `batch_isend_irecv` (torch treats a batch like a collective);
  in the *eager* mode (`init_process_group(device_id=...)`) every point-to-point operation uses
  the group's communicator. Tags are ignored.
- A send and a receive meet when each is at the head of its stream: on one communicator the
  n-th send from a to b is the n-th receive of b from a, and both must agree on bytes and dtype.
  Neither completes alone (a send is a rendezvous: NCCL gives no buffering guarantee).
- A batch is launched as one unit (``ncclGroupStart``/``ncclGroupEnd``): its operations are all
  at the head together, and it completes when all of them have.
- A collective completes once every member of its group has it at the head of its stream: the
  n-th collective of a group on each member, of the same kind (and size, where sizes must
  agree).
- An operation issued after a `wait()` starts after what was waited on (the compute stream
  waits for it, and every NCCL operation waits for the compute stream at issue): the replay
  lets the host go on past a wait only once that operation has completed.

`replay(records, mode)` runs until nothing can move and returns the problems (an empty list when
every operation completes and every message agrees).
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field

MODES = ("lazy", "eager")
SAME_SIZE = (
    "allreduce",
    "broadcast",
    "reduce",
    "barrier",
    "_allgather_base",
    "_reduce_scatter_base",
)
"""Collectives whose payload must be the same on every member (all-to-alls and gathers of
objects may differ)."""


@dataclass(eq=False)  # identity: `op in unit` must not compare fields
class Op:
    rank: int
    id: int
    name: str  # send, recv, or the collective
    group: str
    peer: int  # global rank of the other end of a send or receive, else -1
    nbytes: int
    dtype: str
    batch: int | None
    where: str
    stream: tuple = ()  # the communicator it runs on
    match: tuple = ()  # what it meets: (communicator, src, dst, n) or (group, n)
    done: bool = False

    def __str__(self) -> str:
        peer = f" peer {self.peer}" if self.peer >= 0 else ""
        batch = f" in batch {self.batch}" if self.batch is not None else ""
        return (
            f"rank {self.rank} op {self.id} {self.name}{peer} on group {self.group}{batch} "
            f"({self.nbytes} B {self.dtype}) at {self.where}"
        )


@dataclass
class Rank:
    rank: int
    events: list
    pos: int = 0
    streams: dict = field(default_factory=dict)  # communicator -> deque of units (lists of Ops)


def load(folder: str) -> list[dict]:
    """Every rank's record in `folder`, in rank order."""
    names = sorted(
        (n for n in os.listdir(folder) if n.startswith("rank_") and n.endswith(".json")),
        key=lambda n: int(n[5:-5]),
    )
    records = []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            records.append(json.load(f))
    return records


def _assign(ops: dict, records: list[dict], mode: str) -> dict:
    """Give every op its stream and what it meets; return the members of every group."""
    members = {}
    for rec in records:
        for name, ranks in rec["groups"].items():
            members[name] = tuple(ranks)
    for rec in records:
        counts: dict = {}
        for ev in rec["events"]:
            if ev[0] != "op":
                continue
            op = ops[rec["rank"], ev[1]]
            if op.name in ("send", "recv", "recv_any"):
                alone = op.batch is None and mode == "lazy"
                pair = tuple(sorted((op.rank, op.peer)))
                comm = (op.group, *pair) if alone else (op.group,)
                src, dst = (op.rank, op.peer) if op.name == "send" else (op.peer, op.rank)
                key = (comm, src, dst, op.name)
                n = counts[key] = counts.get(key, -1) + 1
                op.stream, op.match = comm, (comm, src, dst, n)
            else:
                key = ("collective", op.group)
                n = counts[key] = counts.get(key, -1) + 1
                op.stream, op.match = (op.group,), (op.group, n)
    return members


def replay(records: list[dict], mode: str = "lazy") -> list[str]:
    """The problems of running `records` (one per rank) under NCCL's rules in `mode`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ops = {
        (rec["rank"], ev[1]): Op(rec["rank"], *ev[1:])
        for rec in records
        for ev in rec["events"]
        if ev[0] == "op"
    }
    members = _assign(ops, records, mode)
    problems = [
        f"{op}: receive from any source (NCCL has none)"
        for op in ops.values()
        if op.name == "recv_any"
    ]
    ranks = {rec["rank"]: Rank(rec["rank"], rec["events"]) for rec in records}
    by_match: dict[tuple, list[Op]] = {}
    for op in ops.values():
        by_match.setdefault(op.match, []).append(op)

    def issue(r: Rank, op: Op) -> None:
        queue = r.streams.setdefault(op.stream, deque())
        if op.batch is not None and queue and queue[-1][0].batch == op.batch:
            queue[-1].append(op)  # the rest of a batch launches with its first operation
        else:
            queue.append([op])

    def at_head(op: Op) -> bool:
        queue = ranks[op.rank].streams.get(op.stream)
        return bool(queue) and op in queue[0]

    def partners(op: Op) -> list[Op] | None:
        """The ops that complete together with `op`, once all are at their heads."""
        found = by_match.get(op.match, [])
        if op.name in ("send", "recv"):  # both ends share the match key
            return found if {o.name for o in found} == {"send", "recv"} else None
        group, _ = op.match
        return found if len(found) == len(members[group]) else None

    def agree(together: list[Op]) -> None:
        first = together[0]
        if first.name in ("send", "recv"):
            send, recv = sorted(together, key=lambda o: o.name != "send")
            if (send.nbytes, send.dtype) != (recv.nbytes, recv.dtype):
                problems.append(f"size or dtype differs: {send} meets {recv}")
            return
        kinds = {o.name for o in together}
        if len(kinds) > 1:
            problems.append("different collectives meet: " + "; ".join(map(str, together)))
        elif first.name in SAME_SIZE and len({(o.nbytes, o.dtype) for o in together}) > 1:
            problems.append("collective sizes differ: " + "; ".join(map(str, together)))

    moved = True
    while moved:
        moved = False
        for r in ranks.values():  # hosts issue until a wait on an unfinished operation
            while r.pos < len(r.events):
                ev = r.events[r.pos]
                if ev[0] == "op":
                    issue(r, ops[r.rank, ev[1]])
                elif not ops[r.rank, ev[1]].done:
                    break
                r.pos += 1
                moved = True
        for r in ranks.values():
            for queue in r.streams.values():
                if not queue:
                    continue
                for op in queue[0]:
                    if op.done:
                        continue
                    together = partners(op)
                    if together and all(at_head(o) for o in together):
                        agree(together)
                        for o in together:
                            o.done = True
                        moved = True
        for r in ranks.values():
            for queue in r.streams.values():
                while queue and all(o.done for o in queue[0]):
                    queue.popleft()
                    moved = True
    for rank_id, r in sorted(ranks.items()):
        if r.pos < len(r.events):
            ev = r.events[r.pos]
            waits = "wait for " if ev[0] == "wait" else ""
            problems.append(f"rank {rank_id} never gets past: {waits}{ops[rank_id, ev[1]]}")
        for queue in r.streams.values():
            if queue:
                after = f" (and {len(queue) - 1} after it)" if len(queue) > 1 else ""
                problems.append(f"never completes: {' + '.join(map(str, queue[0]))}{after}")
    return problems
