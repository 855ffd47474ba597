"""SIGTERM / Ctrl-C inside `dsnd train`: a flag, not an exit; agreement through the step's
all-gather (the stop column of `gather_stats`)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dsnd.stop_request import StopRequest
from dsnd.telemetry import STATS, stop_agreed


def test_sigterm_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # again: still just the flag
        assert stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_ctrl_c_interrupts():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_one_rank_asking_stops_every_rank():
    stats = torch.zeros(4, len(STATS), dtype=torch.float64)
    assert not stop_agreed(stats)
    stats[2, STATS.index("stop_requested")] = 1.0  # rank 2's request, seen in every rank's copy
    assert stop_agreed(stats)
