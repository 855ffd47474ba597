"""How long each instruction of a step took: the host clock on the CPU, CUDA events on a GPU.

On CUDA, kernels and NCCL run asynchronously. A host clock around an instruction measures its
launch, and a receive's `wait()` does not block the host (the compute stream waits instead), so
host times read the bubble as about 0. An event recorded on the current stream between
instructions measures what the GPU did; a receive's time is then how long the stream waited for
the message: the bubble. The events are read once, at the step's end: one synchronisation per
step, which reporting the step's loss makes anyway.
"""

from __future__ import annotations

import time

import torch

from dsnd.plan import schedule as S
from dsnd.plan.schedule import Instr


class StepClock:
    """Marks between instructions; `laps()` gives the seconds between consecutive marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks = [self._now()]

    def lap(self) -> None:
        self._marks.append(self._now())

    def laps(self) -> list[float]:
        marks = self._marks
        if not self.cuda:
            return [b - a for a, b in zip(marks, marks[1:], strict=False)]
        marks[-1].synchronize()
        pairs = zip(marks, marks[1:], strict=False)
        return [a.elapsed_time(b) / 1e3 for a, b in pairs]  # ms -> s


PHASE = {
    S.FORWARD: "forward",
    S.BACKWARD: "backward",
    S.BACKWARD_INPUT: "backward",
    S.BACKWARD_WEIGHT: "backward",
    S.STEP: "optimizer",
}
"""The phase each instruction's time counts to; receives count as pipeline_wait, everything
else as comm."""


def phase_times(
    program: list[Instr], laps: list[float], blocked_s: float | None, phases: dict[str, float]
) -> None:
    """Add to `phases` the step's times: `laps` holds each instruction's seconds, then the wait
    for the step's sends. `blocked_s` is the host's time blocked in receives (CPU), or None where
    the laps are device times (CUDA): there a receive's lap is the stream's wait for it."""
    for x, spent in zip(program, laps, strict=False):
        phases[PHASE.get(x.op, "comm")] += spent
    phases["comm"] += sum(laps[len(program) :])
    if blocked_s is None:
        blocked_s = sum(s for x, s in zip(program, laps, strict=False) if x.op in S.RECVS)
    phases["pipeline_wait"] = blocked_s
    phases["comm"] -= blocked_s  # receives were counted as comm above
