"""The pure half of ``dsnd bench partition``: the slowest stage of a measured (profile) partition
against the parameter-count one, per stage and layer (from the rank program's raw JSON)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import groupby, pairwise
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed

PARTITION_BENCH = "partition"
PARTITIONS = ("parameters", "profile")  # the baseline first
PARTITION_WORLD = 4  # ranks: pp=4 x dp=1 (they share this machine's cores)
SLOWEST_STAGE_TARGET = Target.below(1.0)
_row = partial(Row, bench=PARTITION_BENCH)


def stage_compute(run: Mapping[str, Any]) -> list[float]:
    """Per stage, the forward and backward compute seconds of one step (`StepResult.times`):
    what a partition balances; receive waits, messages and the optimizer are left out."""
    return [times["forward"] + times["backward"] for times in run["times"]]


def stage_sums(parts: Sequence[int], values: Sequence[float]) -> list[float]:
    """Per stage of boundaries `parts`, the sum of its layers' `values`."""
    return [sum(values[a:b]) for a, b in pairwise(parts)]


def layer_kinds(layers: Sequence[Mapping[str, Any]], start: int, stop: int) -> str:
    """``layers 1..2 (LlamaBlock x2)``: the layers [start, stop) by kind, in order."""
    kinds = Counter(layer["name"] for layer in layers[start:stop])
    what = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in kinds.items())
    return f"layers {start}..{stop - 1} ({what})"


def slowest_stage(run: Mapping[str, Any], measure: str = "compute") -> float:
    """The slowest stage's compute seconds in one step (`stage_compute`), or its largest
    per-rank `measure` (``step_s``, ...)."""
    return max(stage_compute(run) if measure == "compute" else run[measure])


def slowest_ratio(reps: Sequence[Mapping[str, Any]], measure: str = "compute") -> float:
    """Median over paired repetitions of profile's `slowest_stage` / parameters'."""
    base, other = PARTITIONS
    return median(
        slowest_stage(rep["runs"][other], measure) / slowest_stage(rep["runs"][base], measure)
        for rep in reps
    )


def _stage_rows(name: str, raw: Mapping[str, Any], reps: Sequence[Mapping[str, Any]]) -> list[Row]:
    """Per stage of partition `name`: measured compute ms per step (median) and the profile's
    prediction (micro-batches x the summed measured seconds of the stage's layers)."""
    layers, m, parts = raw["layers"], raw["layout"]["micro_batches"], raw["parts"][name]
    predicted = stage_sums(parts, [m * layer["seconds"] for layer in layers])
    params = stage_sums(parts, [layer["params"] for layer in layers])
    rows = []
    for s, (a, b) in enumerate(pairwise(parts)):
        measured = median(stage_compute(rep["runs"][name])[s] for rep in reps)
        note = (
            f"{layer_kinds(layers, a, b)}, {params[s]:.0f} parameters; forward + backward ms per "
            f"step, median; measured / predicted {measured / predicted[s]:.2f}"
        )
        rows += [
            _row(f"partition_{name}_stage{s}_compute_ms", measured * 1e3, note=note),
            _row(f"partition_{name}_stage{s}_predicted_ms", predicted[s] * 1e3),
        ]
    return rows


def _shape(layout: Mapping[str, Any]) -> str:
    return (
        f"pp={layout['pp']} dp={layout['dp']}, {layout['model']} with vocab "
        f"{layout['vocab_size']}, hidden {layout['hidden_size']}, {layout['blocks']} blocks, seq "
        f"{layout['seq_len']}, micro {layout['micro']} x {layout['micro_batches']} micro-batches, "
        f"{layout['schedule']}, ZeRO-{layout['zero_stage']}; {layout['ranks']} ranks on "
        f"{layout['cores']} cores, one thread each"
    )


def layer_costs(layers: Sequence[Mapping[str, Any]]) -> str:
    """The profile's ms per micro-batch of each layer; a run of one kind as one range."""
    out, i = [], 0
    for name, group in groupby(layers, key=lambda layer: layer["name"]):
        ms = [layer["seconds"] * 1e3 for layer in group]
        where = f"{i}" if len(ms) == 1 else f"{i}..{i + len(ms) - 1}"
        cost = f"{ms[0]:.2f}" if len(ms) == 1 else f"{min(ms):.2f}-{max(ms):.2f} each"
        out.append(f"{where} {name} {cost}")
        i += len(ms)
    return ", ".join(out)


def _bound(layers: Sequence[Mapping[str, Any]], slowest_predicted: float) -> str:
    """Why no partition can do better than the slowest single layer, with its numbers."""
    seconds = [layer["seconds"] for layer in layers]
    worst = max(range(len(layers)), key=seconds.__getitem__)
    return (
        "No split into contiguous stages can beat the slowest single layer ("
        f"{layer_kinds(layers, worst, worst + 1)}: {seconds[worst] * 1e3:.2f} ms per micro-batch"
        f" = {seconds[worst] / slowest_predicted:.0%} of {PARTITIONS[0]}' predicted slowest "
        f"stage, {seconds[worst] / sum(seconds):.0%} of all layers' time)"
    )


def _verdict(
    parts: Mapping[str, Sequence[int]], predicted: Mapping[str, float]
) -> tuple[bool, str]:
    """Whether the measured ratio can be judged against its target (the profile moved the
    boundaries and, at its own costs, lowered the slowest stage), and what the note says."""
    base, other = PARTITIONS
    moved = f"profile moved the boundaries ({base} {parts[base]}, profile {parts[other]})"
    if parts[base] == parts[other]:
        return False, (
            f"NOT EVALUATED: profile chose the same boundaries as {base} "
            f"({parts[base]}), so both runs are one program and the ratio is noise "
            "around 1"
        )
    if predicted[other] >= predicted[base]:
        return False, (
            f"NOT EVALUATED: {moved} but not its slowest stage's predicted time, so "
            "the ratio is noise around 1"
        )
    return True, moved


def partition_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Every row of ``dsnd bench partition`` from the rank program's raw JSON."""
    reps, layout, layers, parts = timed(raw), raw["layout"], raw["layers"], raw["parts"]
    base, other = PARTITIONS
    m = layout["micro_batches"]
    seconds = [layer["seconds"] for layer in layers]
    predicted = {name: max(stage_sums(parts[name], seconds)) for name in PARTITIONS}
    judged, verdict = _verdict(parts, predicted)
    first = raw["reps"][0]["runs"]
    loss, base_loss = first[other]["loss"], first[base]["loss"]
    return [
        _row(
            "partition_slowest_stage_ratio",
            slowest_ratio(reps),
            SLOWEST_STAGE_TARGET if judged else None,
            f"{verdict}. The slowest stage's forward + backward seconds per step "
            "(StepResult.times, the compute a partition balances; receive waits, messages and "
            f"the optimizer left out), profile / {base}, median of {len(reps)} paired "
            f"repetitions in alternating order after {layout['warmup']} warm-up; {_shape(layout)}. "
            f"{_bound(layers, predicted[base])}. The profile's costs per micro-batch (forward + "
            "backward of each layer alone, ms, measured once in the launching process, one "
            f"thread): {layer_costs(layers)}",
        ),
        _row(
            "partition_predicted_slowest_stage_ratio",
            predicted[other] / predicted[base],
            SLOWEST_STAGE_TARGET,
            f"what the profile promised: its slowest stage / {base}', both at its own measured "
            f"layer costs ({predicted[other] * m * 1e3:.1f} vs {predicted[base] * m * 1e3:.1f} "
            "ms per step): below 1 only if profile found a split whose slowest stage is faster",
        ),
        *(
            _row(
                f"partition_{name}_slowest_stage_ms",
                median(slowest_stage(rep["runs"][name]) for rep in reps) * 1e3,
                note=f"parts {parts[name]}: the slowest stage's forward + backward ms per step, "
                "median over repetitions",
            )
            for name in PARTITIONS
        ),
        _row(
            "partition_step_time_ratio",
            slowest_ratio(reps, "step_s"),
            note=f"for reference: profile / {base} step time (barrier to the loss on every stage, "
            f"the slowest rank's; median of paired repetitions); {layout['ranks']} ranks share "
            f"{layout['cores']} cores, so it holds their contention and receive waits",
        ),
        _row(
            "partition_first_step_loss_rel_diff",
            abs(loss - base_loss) / abs(base_loss),
            Target.at_most(LOSS_TOLERANCE),
            f"same weights and samples, only the layout differs: first-step loss {loss:.6f} vs "
            f"{base_loss:.6f}",
        ),
        *(row for name in PARTITIONS for row in _stage_rows(name, raw, reps)),
    ]
