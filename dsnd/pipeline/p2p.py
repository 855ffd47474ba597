"""Point-to-point links between pipeline stages, driven by the stage's program.

Sends are asynchronous (`isend`): a stage hands its activation or gradient off and computes on,
so communication overlaps compute; the handles are waited on at the end of the step. Receives
are posted ahead (`irecv`): at the start of a step the links read the program's receives, and
keep one posted per channel — (kind, receiving chunk), each under its own tag — so a message
can land while the stage computes; the stage blocks only when it needs the tensor. Messages on
one channel arrive in send order, which `dsnd.plan.schedule.simulate` checks matches the
receiver's order for every schedule.

With several chunks per stage (interleaved schedules) the stages form a ring: the last stage's
chunk c feeds the first stage's chunk c + 1.

Time blocked in receives is summed in `recv_wait_s`: on a stage, that is the pipeline bubble
(plus transfer time) the schedule leaves it, which `dsnd bench pipeline` measures.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dsnd.distributed.groups import ProcessGroups
from dsnd.plan.schedule import RECVS, Instr, StageRole, channel

TIED_TAG = 0  # pipeline/tied.py's blocking exchange; activations and gradients use 1, 2, ...


def _tag(kind: str, chunk: int) -> int:
    return 1 + 2 * chunk + (kind == "grad")


class StageLinks:
    """This rank's links to the other stages of its pipeline."""

    def __init__(self, groups: ProcessGroups, device: torch.device) -> None:
        self.device = device
        self.group = groups.pipe
        self.ranks = dist.get_process_group_ranks(groups.pipe)
        self._pending: list[dist.Work] = []
        self._posted: dict[tuple, tuple[dist.Work, torch.Tensor]] = {}  # channel -> receive
        self._left: dict[tuple, int] = {}  # channel -> receives still to post this step
        self._shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self._role: StageRole | None = None
        self.recv_wait_s = 0.0  # seconds blocked in receives since construction or the last reset

    def reset_recv_wait(self) -> float:
        """Return `recv_wait_s` and start counting again from zero."""
        waited, self.recv_wait_s = self.recv_wait_s, 0.0
        return waited

    def begin_step(self, role: StageRole, program: list[Instr], shape) -> None:
        """Expect the receives of `program` (activations and gradients of `shape.activation`
        in `shape.dtype`); post the first of each channel."""
        self._role, self._shape = role, (shape.activation, shape.dtype)
        self._left = {}
        for x in program:
            if x.op in RECVS:
                key = channel(role, x)
                self._left[key] = self._left.get(key, 0) + 1
        for key in list(self._left):
            self._post(key)

    def _post(self, key: tuple) -> None:
        if self._left.get(key, 0) > 0:
            self._left[key] -= 1
            src, _, kind, chunk = key
            shape, dtype = self._shape
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, self.ranks[src], group=self.group, tag=_tag(kind, chunk))
            self._posted[key] = (work, buf)

    def recv(self, x: Instr) -> torch.Tensor:
        """The tensor receive instruction `x` names (blocks until it has arrived)."""
        key = channel(self._role, x)
        work, buf = self._posted.pop(key)
        start = time.perf_counter()
        work.wait()
        self.recv_wait_s += time.perf_counter() - start
        self._post(key)
        return buf

    def send(self, x: Instr, tensor: torch.Tensor) -> None:
        """Send `tensor` as send instruction `x` says (asynchronously)."""
        _, dst, kind, chunk = channel(self._role, x)
        work = dist.isend(tensor.detach().contiguous(), self.ranks[dst], group=self.group,
                          tag=_tag(kind, chunk))  # fmt: skip
        self._pending.append(work)

    def wait(self) -> None:
        """Complete every outstanding send (their buffers may then be freed)."""
        assert not self._posted, f"receives still posted at the end of a step: {list(self._posted)}"
        for work in self._pending:
            work.wait()
        self._pending.clear()
