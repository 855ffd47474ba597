"""The pure half of ``dsnd bench overhead``: rows from the rank program's raw JSON.

dsnd's throughput at world 1 (the trainer's step over a DeepSpeed engine) ÷ a plain PyTorch
loop's on the same model, weights, samples, optimizer and schedule: the median of paired
repetitions (plain seconds / dsnd seconds), target ≥ 0.95; dsnd's extra milliseconds per step
for context. The two must compute the same losses (≤ 1e-4), or the ratio is void.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from dsnd.bench.memory_results import max_loss_rel_diff, void
from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed

OVERHEAD_BENCH = "overhead"
THROUGHPUT_TARGET = Target.at_least(0.95)


def overhead_rows(raw: Mapping[str, Any]) -> list[Row]:
    lay, reps = raw["layout"], raw["reps"]
    steps = timed(raw)
    dsnd = [r["runs"]["dsnd"]["step_s"] for r in steps]
    plain = [r["runs"]["plain"]["step_s"] for r in steps]
    ratio = median(p / d for p, d in zip(plain, dsnd, strict=True))
    extra_ms = median((d - p) * 1e3 for p, d in zip(plain, dsnd, strict=True))
    tokens = lay["tokens_per_step"]
    row = partial(Row, bench=OVERHEAD_BENCH)
    measured = [
        row(
            "throughput_ratio",
            ratio,
            THROUGHPUT_TARGET,
            f"dsnd tokens/s / plain PyTorch loop tokens/s at world 1, {lay['model']}, seq "
            f"{lay['seq_len']}, {lay['batch']}, fp32, ZeRO-{lay['zero_stage']}, "
            f"{lay['optimizer']}; dsnd: the trainer's step (batch, StageRunner over a DeepSpeed "
            "engine, loss report, telemetry); plain: forward, backward, clipping, "
            "torch.optim.AdamW and the same schedule; median of "
            f"{len(steps)} paired repetitions in alternating order after "
            f"{len(reps) - len(steps)} warm-up",
        ),
        row(
            "dsnd_overhead_ms_per_step",
            extra_ms,
            note=f"median of dsnd's minus the plain loop's seconds per step, paired; "
            f"{median(dsnd) * 1e3:.1f} vs {median(plain) * 1e3:.1f} ms per step",
        ),
    ]
    diff = max_loss_rel_diff(reps, "dsnd", "plain")
    return [
        *void(measured, diff <= LOSS_TOLERANCE, "losses differ"),
        row("dsnd_tokens_per_s", tokens / median(dsnd)),
        row("plain_tokens_per_s", tokens / median(plain)),
        row(
            "losses_max_rel_diff",
            diff,
            Target.at_most(LOSS_TOLERANCE),
            f"every step of both (same weights, samples, optimizer and schedule); last step: "
            f"dsnd {reps[-1]['runs']['dsnd']['loss']:.6f}, plain "
            f"{reps[-1]['runs']['plain']['loss']:.6f}",
        ),
    ]
