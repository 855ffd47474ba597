"""Phase times of a step from its instruction laps (`dsnd.pipeline.clock`): on the CPU the
host's blocked time in receives is the bubble; on CUDA, where laps are device times from CUDA
events and a receive does not block the host, a receive's own lap is."""

from __future__ import annotations

import pytest
import torch

from dsnd.pipeline.clock import StepClock, phase_times
from dsnd.pipeline.phases import PHASES
from tests.unit.test_schedule import parse

PROGRAM = parse("recv_act0 F0 send_act0 recv_grad0 B0 send_grad0 reduce step")
LAPS = [0.5, 1.0, 0.1, 2.0, 3.0, 0.1, 0.2, 0.4, 0.05]  # each instruction, then the sends' wait


def _phases(blocked):
    phases = dict.fromkeys(PHASES, 0.0)
    phase_times(PROGRAM, LAPS, blocked, phases)
    return phases


def test_device_laps_count_each_receive_as_the_bubble():
    got = _phases(None)
    assert got["pipeline_wait"] == pytest.approx(2.5)  # recv_act0 + recv_grad0
    assert got["forward"] == 1.0 and got["backward"] == 3.0 and got["optimizer"] == 0.4
    assert got["comm"] == pytest.approx(0.1 + 0.1 + 0.2 + 0.05)  # sends, reduce, sends' wait


def test_host_laps_count_the_time_blocked_in_receives():
    got = _phases(1.5)  # the receives' laps hold 1.5 s blocked and 1 s of posting and copying
    assert got["pipeline_wait"] == 1.5
    assert got["comm"] == pytest.approx(0.5 + 2.0 + 0.1 + 0.1 + 0.2 + 0.05 - 1.5)


def test_the_cpu_clock_laps_with_the_host_clock():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    clock.lap()
    clock.lap()
    laps = clock.laps()
    assert not clock.cuda and len(laps) == 2 and all(lap >= 0 for lap in laps)
