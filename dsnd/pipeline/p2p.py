"""Point-to-point links between pipeline stages, driven by the stage's program.

Every one-way channel (activations from stage s to s + 1, gradients back, and with interleaved
schedules the ring's wrap from the last stage to the first) has its own two-rank process group
(`dsnd.distributed.groups.channel_groups`). On NCCL all sends and receives between two ranks of
one group run in issue order on one stream and tags are ignored: on one shared pipe group a
receive posted ahead holds back the send behind it, and 1F1B's steady state (stage s sending an
activation while stage s + 1 sends a gradient back, each then receiving) deadlocks. A group per
channel leaves each stream one direction of one kind of message, received in the order it was
sent (`dsnd.plan.schedule.simulate` checks that on every schedule; the suite replays every
multi-rank test's calls under NCCL's rules, `tests/nccl_rules`). Megatron pairs each step's
exchanges in one `batch_isend_irecv` instead; with a group per channel the schedule needs no
pairing, and a receive can be posted ahead without blocking anything but its own channel.

Sends are asynchronous (`isend`): a stage hands its activation or gradient off and computes on,
so communication overlaps compute; the handles are waited on at the end of the step. Receives
are posted ahead (`irecv`): at the start of a step the links read the program's receives, and
keep up to `POST_AHEAD` posted per channel, so a message can land while the stage computes; the
stage blocks only when it needs the tensor. Where each message goes (channel, peer) is worked
out once per program.

When to post matters as much as how far ahead. gloo matches a send with a receive the receiver
has announced to the sender, and a receive posted right after another one completed costs
0.3-0.4 ms, one posted right after a send about 0.07 ms (2 ranks, 2 cores, llama-tiny at pp=2,
m=8: posts took 3.6 ms of a 70 ms step; docs/benchmarks.md, the `dsnd bench pipeline` section).
So after a receive the links post another only when none is left on that channel, and top every
channel up to `POST_AHEAD` after each send instead; a receive is then announced a whole hand-off
before its message comes.

Time blocked in receives is summed in `recv_wait_s`: on a stage, that is the pipeline bubble
(plus transfer time) the schedule leaves it, which `dsnd bench pipeline` measures.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from dsnd.plan.schedule import RECVS, SENDS, Instr, StageRole, stream

POST_AHEAD = 2  # receives kept posted per channel, at most (see the module docstring)
Channels = dict[tuple[int, int, str], dist.ProcessGroup]  # (from, to, kind) -> its group


def routes(role: StageRole, program: list[Instr]) -> dict[Instr, tuple[int, int, str]]:
    """Each send and receive of `program`: the channel it goes on (`schedule.stream`)."""
    return {x: stream(role, x) for x in program if x.op in SENDS or x.op in RECVS}


class StageLinks:
    """This rank's links to the other stages of its pipeline."""

    def __init__(
        self,
        channels: Channels,
        pipe_ranks: list[int],
        device: torch.device,
        ahead: int = POST_AHEAD,
    ) -> None:
        if ahead < 1:
            raise ValueError(f"need at least one receive posted ahead, got {ahead}")
        self.device, self.ahead = device, ahead
        self.channels = channels
        me = pipe_ranks.index(dist.get_rank())  # this rank's stage
        self._peer: dict[tuple[int, int, str], int] = {}  # the peer's rank in a channel's group
        for (src, dst, kind), group in channels.items():
            other = pipe_ranks[dst if src == me else src]
            self._peer[src, dst, kind] = dist.get_group_rank(group, other)
        self._pending: list[dist.Work] = []
        self._posted: dict[tuple, deque] = {}  # channel -> posted (work, buffer), in order
        self._left: dict[tuple, int] = {}  # channel -> receives still to post this step
        self._shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self._program: list[Instr] | None = None  # the program `_routes` was worked out for
        self._role: StageRole | None = None
        self._routes: dict[Instr, tuple[int, int, str]] = {}
        self._counts: dict[tuple, int] = {}  # channel -> receives per step
        self.recv_wait_s = 0.0  # seconds blocked in receives since construction or the last reset

    def reset_recv_wait(self) -> float:
        """Return `recv_wait_s` and start counting again from zero."""
        waited, self.recv_wait_s = self.recv_wait_s, 0.0
        return waited

    def begin_step(self, role: StageRole, program: list[Instr], shape) -> None:
        """Expect the receives of `program` (activations and gradients of `shape.activation`
        in `shape.dtype`); post the first `ahead` of each channel."""
        if program is not self._program or role != self._role:
            self._routes = routes(role, program)
            self._counts = {}
            for x, key in self._routes.items():
                if x.op in RECVS:
                    self._counts[key] = self._counts.get(key, 0) + 1
            self._program, self._role = program, role
        self._shape = (shape.activation, shape.dtype)
        self._left = dict(self._counts)
        for key in self._left:
            self._posted[key] = deque()
            self._post(key)

    def _post(self, key: tuple, upto: int | None = None) -> None:
        """Top channel `key` up to `upto` (default `ahead`) posted receives, as far as the step
        has any left."""
        queue, left = self._posted[key], self._left[key]
        upto = self.ahead if upto is None else upto
        while left > 0 and len(queue) < upto:
            left -= 1
            shape, dtype = self._shape
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            # the process group's own receive: torch.distributed's irecv would translate the
            # peer's global rank back to this group rank on every message
            queue.append((self.channels[key].recv([buf], self._peer[key], 0), buf))
        self._left[key] = left

    def recv(self, x: Instr) -> torch.Tensor:
        """The tensor receive instruction `x` names (blocks until it has arrived)."""
        key = self._routes[x]
        queue = self._posted[key]
        work, buf = queue.popleft()
        start = time.perf_counter()
        work.wait()
        self.recv_wait_s += time.perf_counter() - start
        self._post(key, upto=1)  # never none: the peer's next send must find one waiting
        return buf

    def send(self, x: Instr, tensor: torch.Tensor) -> None:
        """Send `tensor` as send instruction `x` says (asynchronously); then top every channel up
        to `ahead` posted receives (see the module docstring)."""
        key = self._routes[x]
        group = self.channels[key]
        self._pending.append(group.send([tensor.detach().contiguous()], self._peer[key], 0))
        for key in self._left:
            self._post(key)

    def wait(self) -> None:
        """Complete every outstanding send (their buffers may then be freed)."""
        posted = [key for key, queue in self._posted.items() if queue]
        assert not posted, f"receives still posted at the end of a step: {posted}"
        for work in self._pending:
            work.wait()
        self._pending.clear()
