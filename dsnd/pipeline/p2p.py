"""Point-to-point links between neighbouring pipeline stages.

Sends are asynchronous (`isend`): a stage hands its activation or gradient off and computes on,
so communication overlaps compute; the handles are waited on at the end of the step. Receives
block, which is where the schedule's dependencies are enforced. Messages between two stages
travel in one direction each (activations forward, gradients backward) and arrive in send order.

Time blocked in receives is summed in `recv_wait_s`: on a stage, that is the pipeline bubble
(plus transfer time) the schedule leaves it, which `dsnd bench pipeline` measures.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dsnd.dist.groups import ProcessGroups


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
        self.recv_wait_s = 0.0  # seconds blocked in receives since construction or the last reset

    def reset_recv_wait(self) -> float:
        """Return `recv_wait_s` and start counting again from zero."""
        waited, self.recv_wait_s = self.recv_wait_s, 0.0
        return waited

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._pending.append(dist.isend(tensor.detach().contiguous(), dst, group=self.group))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        start = time.perf_counter()
        dist.recv(buf, src, group=self.group)
        self.recv_wait_s += time.perf_counter() - start
        return buf

    def send_activation(self, tensor: torch.Tensor) -> None:
        assert self.next is not None, "the last stage sends no activations"
        self._send(tensor, self.next)

    def recv_activation(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.prev is not None, "the first stage receives no activations"
        return self._recv(shape, dtype, self.prev)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        assert self.prev is not None, "the first stage sends no gradients"
        self._send(tensor, self.prev)

    def recv_gradient(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.next is not None, "the last stage receives no gradients"
        return self._recv(shape, dtype, self.next)

    def wait(self) -> None:
        """Complete every outstanding send (their buffers may then be freed)."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
