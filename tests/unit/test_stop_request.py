"""SIGTERM / Ctrl-C inside `dsnd train`: a flag, not an exit; agreement through the step's
all-gather (the stop column of `gather_stats`)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dsnd.report.telemetry import STATS, stop_agreed
from dsnd.stop_request import StopRequest


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


def test_checkpoint_at_end_false_saves_only_on_every():
    """`checkpoint.at_end: false` (what benchmarks and plan --validate run with): no save when
    training ends, the periodic ones still."""
    from dsnd.config.load import load
    from dsnd.trainer import _should_save

    default = load(None, ["train.steps=6"]).run
    assert [_should_save(default, s) for s in (3, 6)] == [False, True]
    quiet = load(None, ["train.steps=6", "checkpoint.at_end=false", "checkpoint.every=4"]).run
    assert [_should_save(quiet, s) for s in (4, 6)] == [True, False]


def test_a_second_ctrl_c_waits_for_the_save_under_way():
    """Inside `saving` a second SIGINT is held (an interrupted save would leave half a
    checkpoint) and interrupts once the save is done; a save that fails keeps its own error."""
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt), stop.saving():
            os.kill(os.getpid(), signal.SIGINT)
            done = True  # the save went on
        assert done
        with pytest.raises(OSError), stop.saving():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError(28, "No space left on device")
        with stop.saving():  # nothing held over from before
            pass
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # outside a save: at once, as before
