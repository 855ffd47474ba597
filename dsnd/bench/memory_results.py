"""The pure half of ``dsnd bench zero-memory`` and ``dsnd bench activation-checkpointing``: rows
from the rank programs' raw JSON.

zero-memory (`zero_memory_rows`): per ZeRO stage, each rank's largest model-state bytes over a
step (read after every backward, the reduction and the optimizer step) ÷ the repo's one formula,
`dsnd.plan.memory.model_state_bytes`, for the parameters of the rank's own pipeline stage;
target within ±5%. The rank farthest from 1 is reported. The bytes right after the step's
reduction (what the optimizer step starts from) ÷ the formula follow, for context.

activation-checkpointing (`checkpointing_rows`): the same model and samples with
``parallel.activation_checkpoint_interval`` off and on: the peak bytes autograd saved for
backward (`ActivationMeter`) on ÷ off, target ≤ 0.35; what checkpointing keeps ÷ what it
should keep (`checkpointed_bytes`); step time on ÷ off, target ≤ 1.35. Both runs must give the
same losses (≤ 1e-4), or the ratios are void.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed
from dsnd.model.checkpointing import chunk_bounds
from dsnd.plan.memory import held_gradient_bytes, model_state_bytes

PARTS = ("params", "grads", "master", "optimizer")
ZERO_BENCH = "zero-memory"
ZERO_TARGET = Target.near(1.0, 0.05)
CHECKPOINTING_BENCH = "activation-checkpointing"
ACTIVATION_TARGET = Target.at_most(0.35)
STEP_TIME_TARGET = Target.at_most(1.35)
INT64, FP32 = 8, 4
Point = tuple[str, Mapping[str, int]]


# --- zero-memory ---------------------------------------------------------------------------


def formula_bytes(stage: int, psi: int, nd: int, layout: Mapping[str, Any]) -> dict[str, float]:
    """`model_state_bytes` per part for one rank, wherever the part lives (device or CPU), with
    the gradients a dsnd step holds whole until its one reduction (`held_gradient_bytes`): the
    peak the planner predicts."""
    where = model_state_bytes(stage, psi, nd, layout["bf16"], state_bytes=layout["state_bytes"])
    out = {p: where["device"].get(p, 0.0) + where["cpu"].get(p, 0.0) for p in PARTS}
    out["grads"] += held_gradient_bytes(stage, psi, nd, layout["bf16"])
    return out


def peak_point(points: Sequence[Point]) -> Point:
    """The probed point with the most model-state bytes (the first of equals)."""
    if not points:
        raise ValueError("no probed points")
    return max(points, key=lambda point: sum(point[1][p] for p in PARTS))


def reduction_point(points: Sequence[Point]) -> Point:
    """The first point right after a step's gradient reduction."""
    return next(point for point in points if point[0] == "reduce")


def _total(parts: Mapping[str, float]) -> float:
    return float(sum(parts[p] for p in PARTS))


def _breakdown(parts: Mapping[str, float]) -> str:
    return " + ".join(f"{p} {parts[p]:.0f}" for p in PARTS) + f" = {_total(parts):.0f}"


def _whole_grads_note(stage: int, grads: float, psi: int, layout: Mapping[str, Any]) -> str:
    whole = (2 if layout["bf16"] else 4) * psi
    if stage < 2 or grads < whole:
        return ""
    return (
        f" Gradients at the peak: {grads:.0f} bytes >= the stage's whole gradients "
        f"({whole}): dsnd's StageEngine coalesces a step's gradient reductions into one at "
        "the step's end (dsnd.engine.stage_engine), so until then every rank accumulates "
        "its stage's whole gradients and ZeRO-2/3 partition them only from the reduction on"
        + (" (ZeRO-3 keeps its gradient partition buffer besides)" if stage == 3 else "")
        + "."
    )


def _zero_stage_rows(
    stage: int, ranks: Sequence[Mapping[str, Any]], layout: Mapping[str, Any]
) -> list[Row]:
    ratios = []
    for record in ranks:
        want = formula_bytes(stage, record["psi"], record["nd"], layout)
        ratios.append(_total(peak_point(record["points"])[1]) / _total(want))
    worst = max(range(len(ranks)), key=lambda r: abs(ratios[r] - 1.0))
    record = ranks[worst]
    psi, nd = record["psi"], record["nd"]
    want = formula_bytes(stage, psi, nd, layout)
    where, peak = peak_point(record["points"])
    _, reduced = reduction_point(record["points"])
    every = ", ".join(f"{r:.3f}" for r in ratios)
    missing = ""
    if stage in (1, 2) and reduced["grads"] < want["grads"]:
        missing = (
            " ZeRO 1-2 hold the reduced gradient partition the optimizer step reads "
            "(Psi/Nd gradients) in DeepSpeed's averaged_gradients, not in the "
            "parameters' .grad, and dsnd.engine.memory does not count it: grads read "
            "low here."
        )
    row = partial(Row, bench=ZERO_BENCH)
    return [
        row(
            f"zero{stage}_state_bytes_vs_formula",
            _total(peak) / _total(want),
            ZERO_TARGET,
            f"pp={layout['pp']} x dp={layout['dp']}, ZeRO-{stage}; rank {worst} (pipeline stage "
            f"{record['stage']}, Psi {psi}, Nd {nd}), its most model-state bytes in a step "
            f"(after {where}): measured {_breakdown(peak)}; formula (model_state_bytes + "
            f"held_gradient_bytes, {layout['optimizer']} {layout['state_bytes']} B/param) "
            f"{_breakdown(want)}; every "
            f"rank's ratio: {every}." + _whole_grads_note(stage, peak["grads"], psi, layout),
        ),
        row(
            f"zero{stage}_state_bytes_at_reduction_vs_formula",
            _total(reduced) / _total(want),
            note=f"rank {worst} right after the step's gradient reduction: measured "
            f"{_breakdown(reduced)}." + missing,
        ),
    ]


def zero_memory_rows(raw: Mapping[str, Any]) -> list[Row]:
    layout = raw["layout"]
    rows = []
    for stage in sorted(raw["stages"], key=int):
        rows += _zero_stage_rows(int(stage), raw["stages"][stage], layout)
    return rows


# --- activation-checkpointing ----------------------------------------------------------------


def checkpointed_bytes(
    layers: int, interval: int, micro: int, seq: int, hidden: int, vocab: int
) -> int:
    """Bytes autograd keeps for one micro-batch of a whole fp32 model (pp=1) checkpointed every
    `interval` of its `layers` pipeline layers: each chunk's input (the token ids, int64, for
    the first; a (micro, seq, hidden) fp32 activation for every other), and what the loss,
    outside any chunk, saves: its fp32 log-probabilities (micro, seq, vocab) and int64 labels.
    The last chunk's output (the logits) is freed once the loss has its log-probabilities."""
    tokens = micro * seq
    chunks = len(chunk_bounds(layers, interval))
    return tokens * (INT64 + (chunks - 1) * hidden * FP32 + vocab * FP32 + INT64)


def max_loss_rel_diff(reps: Sequence[Mapping[str, Any]], a: str, b: str) -> float:
    """Largest relative difference of side `a`'s losses from side `b`'s over `reps` (every
    repetition, warm-up included: each trains the same step on both)."""
    return max(
        abs(r["runs"][a]["loss"] - r["runs"][b]["loss"]) / abs(r["runs"][b]["loss"]) for r in reps
    )


def void(rows: list[Row], ok: bool, why: str) -> list[Row]:
    """`rows` without their targets and marked VOID unless `ok`."""
    if ok:
        return rows
    return [Row(r.metric, r.value, None, f"VOID ({why}): {r.note}", r.bench) for r in rows]


def _activation_rows(
    lay: Mapping[str, Any], off: Mapping[str, Any], on: Mapping[str, Any]
) -> list[Row]:
    """The first step's peak saved bytes, on ÷ off and on ÷ `checkpointed_bytes`."""
    mib = 2**20
    want = checkpointed_bytes(
        lay["layers"], lay["interval"], lay["micro"], lay["seq_len"], lay["hidden"], lay["vocab"]
    )
    chunks = len(chunk_bounds(lay["layers"], lay["interval"]))
    tokens = lay["micro"] * lay["seq_len"]
    shape = (
        f"{lay['model']}, seq {lay['seq_len']}, micro-batches of {lay['micro']} "
        f"({lay['batch']}), pp=1, fp32"
    )
    row = partial(Row, bench=CHECKPOINTING_BENCH)
    return [
        row(
            "activation_peak_ratio",
            on["activation_peak_bytes"] / off["activation_peak_bytes"],
            ACTIVATION_TARGET,
            f"peak bytes saved for backward in a step (ActivationMeter), checkpointing every "
            f"{lay['interval']} layer(s) / off, {shape}: {on['activation_peak_bytes'] / mib:.2f} "
            f"vs {off['activation_peak_bytes'] / mib:.2f} MiB (one micro-batch in flight). Kept: "
            f"the input of each of the {chunks} chunks of {lay['layers']} layers (token ids, "
            f"then {chunks - 1} x {lay['hidden']} fp32 per token"
            + (": every block's, the final norm's and the head's" if lay["interval"] == 1 else "")
            + f") and the loss's log-probs ({lay['vocab']} fp32 per token) "
            f"and labels: {want / tokens:.0f} B per token against "
            f"{off['activation_peak_bytes'] / tokens:.0f} without checkpointing (every layer's "
            "intermediates: norms, q/k/v, attention, MLP)",
        ),
        row(
            "checkpointed_bytes_vs_predicted",
            on["activation_peak_bytes"] / want,
            note=f"measured {on['activation_peak_bytes']} / {want} predicted bytes "
            "(checkpointed_bytes: chunk inputs + the loss's log-probs and labels)",
        ),
    ]


def _step_time_row(raw: Mapping[str, Any]) -> Row:
    """Seconds per step on ÷ off, the median over the timed (paired) repetitions."""
    reps = raw["reps"]
    steps = timed(raw)
    ratio = median(r["runs"]["on"]["step_s"] / r["runs"]["off"]["step_s"] for r in steps)
    secs = {
        side: {
            k: median(r["runs"][side][k] for r in steps)
            for k in ("step_s", "forward_s", "backward_s")
        }
        for side in ("off", "on")
    }
    return Row(
        "step_time_ratio",
        ratio,
        STEP_TIME_TARGET,
        f"seconds per step on / off, median of {len(steps)} paired repetitions in "
        f"alternating order after {len(reps) - len(steps)} warm-up: off "
        f"{secs['off']['step_s']:.3f} s (forward {secs['off']['forward_s']:.3f}, backward "
        f"{secs['off']['backward_s']:.3f}), on {secs['on']['step_s']:.3f} s (forward "
        f"{secs['on']['forward_s']:.3f}, backward {secs['on']['backward_s']:.3f}): the "
        "backward reruns every chunk's forward",
        bench=CHECKPOINTING_BENCH,
    )


def checkpointing_rows(raw: Mapping[str, Any]) -> list[Row]:
    lay, reps = raw["layout"], raw["reps"]
    off, on = reps[0]["runs"]["off"], reps[0]["runs"]["on"]  # the meter measures the first step
    measured = [*_activation_rows(lay, off, on), _step_time_row(raw)]
    diff = max_loss_rel_diff(reps, "on", "off")
    ok = diff <= LOSS_TOLERANCE
    return [
        *void(measured, ok, "losses differ"),
        Row(
            "losses_max_rel_diff",
            diff,
            Target.at_most(LOSS_TOLERANCE),
            f"every step of both runs (same weights and samples): they must agree, or the "
            f"ratios are void; last step: on {reps[-1]['runs']['on']['loss']:.6f}, off "
            f"{reps[-1]['runs']['off']['loss']:.6f}",
            bench=CHECKPOINTING_BENCH,
        ),
    ]
