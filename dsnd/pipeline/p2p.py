"""Point-to-point links between neighbouring pipeline stages.

Sends are asynchronous (`isend`): a stage hands its activation or gradient off and computes on,
so communication overlaps compute; the handles are waited on at the end of the step. Receives
are posted ahead (`irecv`), one per direction, as soon as the previous one is consumed, so a
message can land while the stage computes; the stage blocks only when it needs the tensor, which
is where the schedule's dependencies are enforced. Activations and gradients travel under their
own tags, in send order.

Time blocked in receives is summed in `recv_wait_s`: on a stage, that is the pipeline bubble
(plus transfer time) the schedule leaves it, which `dsnd bench pipeline` measures.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dsnd.distributed.groups import ProcessGroups

ACTIVATION, GRADIENT = 1, 2  # message tags; tied weights (pipeline/tied.py) use the default 0


class StageLinks:
    """This rank's links to the previous and next stage of its pipeline."""

    def __init__(self, groups: ProcessGroups, device: torch.device) -> None:
        self.device = device
        ranks = dist.get_process_group_ranks(groups.pipe)
        stage = groups.coord.pp
        self.group = groups.pipe
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage + 1 < len(ranks) else None
        self._pending: list[dist.Work] = []
        # per tag: the posted receive (work, buffer) and how many more this step expects
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._left: dict[int, int] = {}
        self._spec: tuple[tuple[int, ...], torch.dtype] | None = None
        self.recv_wait_s = 0.0  # seconds blocked in receives since construction or the last reset

    def reset_recv_wait(self) -> float:
        """Return `recv_wait_s` and start counting again from zero."""
        waited, self.recv_wait_s = self.recv_wait_s, 0.0
        return waited

    def begin_step(
        self, shape: tuple[int, ...], dtype: torch.dtype, activations: int, gradients: int
    ) -> None:
        """Expect `activations` and `gradients` messages of `shape` this step; post the first."""
        self._spec = (shape, dtype)
        self._left = {ACTIVATION: activations, GRADIENT: gradients}
        for tag in (ACTIVATION, GRADIENT):
            self._post(tag)

    def _peer(self, tag: int) -> int | None:
        return self.prev if tag == ACTIVATION else self.next

    def _post(self, tag: int) -> None:
        if self._left.get(tag, 0) > 0 and self._peer(tag) is not None:
            self._left[tag] -= 1
            shape, dtype = self._spec
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._posted[tag] = (dist.irecv(buf, self._peer(tag), group=self.group, tag=tag), buf)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        work = dist.isend(tensor.detach().contiguous(), dst, group=self.group, tag=tag)
        self._pending.append(work)

    def _recv(self, tag: int) -> torch.Tensor:
        work, buf = self._posted.pop(tag)
        start = time.perf_counter()
        work.wait()
        self.recv_wait_s += time.perf_counter() - start
        self._post(tag)
        return buf

    def send_activation(self, tensor: torch.Tensor) -> None:
        assert self.next is not None, "the last stage sends no activations"
        self._send(tensor, self.next, ACTIVATION)

    def recv_activation(self) -> torch.Tensor:
        assert self.prev is not None, "the first stage receives no activations"
        return self._recv(ACTIVATION)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        assert self.prev is not None, "the first stage sends no gradients"
        self._send(tensor, self.prev, GRADIENT)

    def recv_gradient(self) -> torch.Tensor:
        assert self.next is not None, "the last stage receives no gradients"
        return self._recv(GRADIENT)

    def wait(self) -> None:
        """Complete every outstanding send (their buffers may then be freed)."""
        assert not self._posted, f"receives still posted at the end of a step: {list(self._posted)}"
        for work in self._pending:
            work.wait()
        self._pending.clear()
