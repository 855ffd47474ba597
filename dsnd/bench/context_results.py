"""The pure half of ``dsnd bench context``: rows from the rank program's raw JSON.

Per sequence length and context-parallel layout:
- activation peak per rank ÷ the cp=1 figure (whole sequences), target ≤ 1.1/cp: what context
  parallelism buys is activation memory per rank, and a rank holding 1/cp of every sequence
  should hold about 1/cp of its activations (10% slack for what does not shrink with it);
- ring ÷ Ulysses throughput at the same cp (steps per second), target ≥ 0.5: the ring's
  blockwise attention and cp point-to-point rounds against one all-to-all and a fused kernel;
- each layout's losses against cp=1's (the same samples: a benchmark of a wrong computation is
  void), and the absolute numbers for context.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target

CONTEXT_BENCH = "context"
BASELINE = "cp1"
RING_VS_ULYSSES = Target.at_least(0.5)
_row = partial(Row, bench=CONTEXT_BENCH)


def cp_of(layout: str) -> int:
    return int(layout.rsplit("cp", 1)[1])


def memory_target(cp: int) -> Target:
    return Target.at_most(round(1.1 / cp, 4))


def _same_losses(run: Mapping[str, Any], base: Mapping[str, Any]) -> float:
    """Largest relative difference of `run`'s losses from `base`'s."""
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"], base["losses"], strict=True))


def context_rows(raw: Mapping[str, Any]) -> list[Row]:
    rows = []
    for seq in raw["seqs"]:
        runs = {name: raw["runs"][f"{seq}/{name}"] for name in raw["layouts"]}
        base = runs[BASELINE]
        rows.append(
            _row(f"seq{seq} cp1 activation peak MiB/rank", base["activation_peak_bytes"] / 2**20)
        )
        for name, run in runs.items():
            if name == BASELINE:
                continue
            ratio = run["activation_peak_bytes"] / base["activation_peak_bytes"]
            mib = run["activation_peak_bytes"] / 2**20
            rows.append(
                _row(
                    f"seq{seq} {name} activation peak / cp1",
                    ratio,
                    memory_target(cp_of(name)),
                    f"{mib:.1f} MiB per rank",
                )
            )
            rows.append(
                _row(
                    f"seq{seq} {name} losses vs cp1 (max rel diff)",
                    _same_losses(run, base),
                    Target.at_most(LOSS_TOLERANCE),
                )
            )
        for cp in sorted({cp_of(n) for n in runs if n != BASELINE}):
            ring, ulysses = runs[f"ring-cp{cp}"], runs[f"ulysses-cp{cp}"]
            note = (
                f"ring {ring['step_s']:.2f} s/step, ulysses {ulysses['step_s']:.2f}, "
                f"cp1 {base['step_s']:.2f}"
            )
            speed = ulysses["step_s"] / ring["step_s"]
            rows.append(
                _row(f"seq{seq} cp{cp} ring / ulysses throughput", speed, RING_VS_ULYSSES, note)
            )
    return rows
