"""The pure half of ``dsnd bench checkpoint``: rows from the rank program's raw JSON.

What a save costs the steps it interrupts, as a ratio to the steps of the same run without one
(the median of the baseline steps before each save): synchronous, the step that saves (it waits
for the save); with ``checkpoint.async``, the mean over the steps that ran while the write was in
flight, the one that started it included (target ≤ 1.2). How long a save takes, in steps: the
synchronous save's seconds over a baseline step (the bench needs several, or there is nothing
to hide), and the steps an asynchronous save stayed in flight. Medians over the timed saves.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from dsnd.bench.rows import Row, Target, median, timed

CHECKPOINT_BENCH = "checkpoint"
ASYNC_TARGET = Target.at_most(1.2)
SAVE_STEPS_TARGET = Target.at_least(3.0)  # a save long enough to measure what async hides


def save_numbers(rep: Mapping[str, Any]) -> dict[str, float]:
    """One save's numbers: the steps during it ÷ the baseline step, and its length in steps."""
    base = median(rep["baseline_s"])
    during = rep["during_s"]
    if rep["mode"] == "sync":
        (saving,) = during  # the step that saves, its save included
        return {"ratio": saving / base, "steps": (saving - base) / base}
    return {"ratio": sum(during) / len(during) / base, "steps": float(len(during))}


def checkpoint_rows(raw: Mapping[str, Any]) -> list[Row]:
    lay = raw["layout"]
    saves = timed(raw)
    got = {
        mode: [save_numbers(r) for r in saves if r["mode"] == mode] for mode in ("sync", "async")
    }
    if not got["sync"] or not got["async"]:
        raise ValueError("no timed save of each mode")
    base = median(s for r in saves for s in r["baseline_s"])
    what = (
        f"{lay['model']}, seq {lay['seq_len']}, {lay['batch']}, fp32, ZeRO-{lay['zero_stage']}, "
        f"{lay['optimizer']}, {lay['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint, on "
        f"{lay['device']}; baseline step {base * 1e3:.0f} ms (median); median of "
        f"{len(got['sync'])} saves each"
    )
    row = partial(Row, bench=CHECKPOINT_BENCH)
    return [
        row(
            "sync_step_ratio",
            median(n["ratio"] for n in got["sync"]),
            note=f"the step that saves (it waits for the save) ÷ a step without a save; {what}",
        ),
        row(
            "sync_save_steps",
            median(n["steps"] for n in got["sync"]),
            SAVE_STEPS_TARGET,
            "a synchronous save's seconds ÷ a step's",
        ),
        row(
            "async_step_ratio",
            median(n["ratio"] for n in got["async"]),
            ASYNC_TARGET,
            "checkpoint.async: the mean step while the write was in flight, the step that "
            "started it included, ÷ a step without a save",
        ),
        row(
            "async_save_steps",
            median(n["steps"] for n in got["async"]),
            note="steps that began while the asynchronous save was in flight",
        ),
    ]
