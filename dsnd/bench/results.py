"""The pure half of ``dsnd bench pipeline``: theory, formulas and its rows (the schedule phases'
rows are `dsnd.bench.schedule_results`'; medians, targets and output are `dsnd.bench.rows`).

The rank program (`dsnd.bench.pipeline_rank`) records raw timings and byte counts; everything
derived from them is computed here, from plain numbers, so it is unit-tested without processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed
from dsnd.bench.schedule_results import schedule_rows

WORLD = 2  # ranks: pp=2 x dp=1 for the pipeline, pp=1 x dp=2 for ZeRO
PP4_WORLD = 4  # ranks of the pp=4 schedule phase (4 ranks share this machine's cores)


def bubble_theory(num_stages: int, num_micro: int) -> float:
    """Idle fraction of a 1F1B (or GPipe) step: (p - 1) / (m + p - 1).

    With equal forward+backward time t per micro-batch on every stage, a step lasts
    (m + p - 1) t and each stage computes m t of it; the other (p - 1) t it waits while the
    pipeline fills and drains.
    """
    if num_stages < 1 or num_micro < 1:
        raise ValueError(f"need num_stages >= 1 and num_micro >= 1, got {num_stages}, {num_micro}")
    return (num_stages - 1) / (num_micro + num_stages - 1)


def bubble_fraction(wait_s: Sequence[float], busy_s: Sequence[float]) -> float:
    """Measured idle fraction of one pipeline step, averaged over its stages.

    Stage s started with the others (a barrier) and returned from its step after `busy_s[s]`,
    having spent `wait_s[s]` of that blocked in receives. The step lasts T = max(busy_s); the
    stage idles for its receive waits (fill, and any stall in the steady phase) plus T -
    busy_s[s] after its own last action (drain: the earlier stages' last backwards).
    """
    if len(wait_s) != len(busy_s) or not busy_s:
        raise ValueError("need one wait and one busy time per stage")
    step = max(busy_s)
    if step <= 0:
        raise ValueError(f"step time must be > 0, got {step}")
    idle = [w + (step - b) for w, b in zip(wait_s, busy_s, strict=True)]
    return sum(idle) / (len(idle) * step)


# --- ZeRO model-state bytes ------------------------------------------------------------------

STATE_PARTS = ("params", "grads", "master", "optimizer")

# fp32 bytes per parameter of each part, and whether the part is split over the Nd
# data-parallel ranks, as DeepSpeed 0.19.8 holds them in fp32 training with Adam (m and v).
# Both stages keep a separate fp32 master copy of the rank's partition although the parameters
# are fp32 already: ZeRO-1 clones it (stage_1_and_2.py `.detach().clone()`); ZeRO-3 means to
# reuse the parameter shard when dtype and device match, but compares `tensor.device` (a
# torch.device) with `self.device` (a str such as 'cpu'), which is never equal, so it clones too.
# That is the ZeRO paper's formula with 4-byte parameters and gradients and K = 12 (master, m,
# v): per rank ZeRO-1 = 4Psi + 4Psi + 12Psi/Nd, ZeRO-3 = (4 + 4 + 12)Psi/Nd. ZeRO-1 accumulates
# whole gradients until the boundary reduction; ZeRO-3 reduce-scatters each backward into a
# 1/Nd flat partition buffer.
DEEPSPEED_FP32: dict[int, dict[str, tuple[int, bool]]] = {
    1: {"params": (4, False), "grads": (4, False), "master": (4, True), "optimizer": (8, True)},
    3: {"params": (4, True), "grads": (4, True), "master": (4, True), "optimizer": (8, True)},
}
# The same accounting with the fp32 parameters serving as the master (K = 8: m and v only):
# ZeRO-1 = 4Psi + 4Psi + 8Psi/Nd, ZeRO-3 = (4 + 4 + 8)Psi/Nd. What an fp32 optimizer that steps
# the parameters in place would hold.
TEXTBOOK_FP32: dict[int, dict[str, tuple[int, bool]]] = {
    1: {"params": (4, False), "grads": (4, False), "master": (0, True), "optimizer": (8, True)},
    3: {"params": (4, True), "grads": (4, True), "master": (0, True), "optimizer": (8, True)},
}


Formula = Mapping[int, Mapping[str, tuple[int, bool]]]


def zero_state_bytes(
    stage: int, psi: int, nd: int, table: Formula = DEEPSPEED_FP32
) -> dict[str, float]:
    """Formula bytes per rank of each of `STATE_PARTS` for `psi` parameters over `nd` ranks."""
    if stage not in table:
        raise ValueError(f"no formula for ZeRO stage {stage}; known: {sorted(table)}")
    if psi < 0 or nd < 1:
        raise ValueError(f"need psi >= 0 and nd >= 1, got {psi}, {nd}")
    return {
        part: per_param * psi / (nd if split else 1)
        for part, (per_param, split) in table[stage].items()
    }


# --- throughput, bubble and ZeRO rows ----------------------------------------------------------


THROUGHPUT_TARGET = Target.at_least(1.0)
# 1F1B's theory assumes equal per-stage compute and free messages; dsnd's stages are balanced by
# parameter count (not time), messages cost a little and the optimizer step is not pipelined, so
# a measurement within a factor of 2 either way is the 1F1B shape. Serialised stages (no
# overlap at all) would idle ~(p - 1)/p of a step, 4.5x the theory at p=2, m=8.
BUBBLE_TARGET = Target.between(0.5, 2.0)
ZERO_REL = 0.10


def _step_times(reps: Sequence[Mapping[str, Any]], side: str) -> list[float]:
    """Per repetition: the slowest rank's time (a step is done when every rank is)."""
    return [max(rep[side]["step_s"]) for rep in reps]


def loss_rel_diff(rep: Mapping[str, Any]) -> float:
    ours, theirs = rep["dsnd"]["loss"], rep["deepspeed"]["loss"]
    return abs(ours - theirs) / abs(theirs)


def throughput_rows(raw: Mapping[str, Any]) -> list[Row]:
    reps, layout = timed(raw), raw["layout"]
    ours, theirs = _step_times(reps, "dsnd"), _step_times(reps, "deepspeed")
    ratio = median(t / o for o, t in zip(ours, theirs, strict=True))
    tokens = layout["tokens_per_step"]
    shape = (
        f"pp={layout['pp']} dp={layout['dp']}, {layout['preset']} fp32, micro {layout['micro']} x "
        f"{layout['gas']} micro-batches x seq {layout['seq_len']}, partition "
        f"{layout['partition']}"
    )
    first, last = raw["reps"][0], raw["reps"][-1]  # rep r trains step r on both sides
    return [
        Row(
            "throughput_ratio",
            ratio,
            THROUGHPUT_TARGET,
            f"dsnd 1F1B tokens/s / DeepSpeed PipelineEngine (ZeRO-1) tokens/s, {shape}; median of "
            f"{len(reps)} interleaved paired repetitions after {layout['warmup']} warm-up",
        ),
        Row("dsnd_tokens_per_s", tokens / median(ours)),
        Row("deepspeed_tokens_per_s", tokens / median(theirs)),
        Row(
            "first_step_loss_rel_diff",
            loss_rel_diff(first),
            Target.at_most(LOSS_TOLERANCE),
            "both sides start from the same weights and train on the same samples: the first "
            f"step's losses ({first['dsnd']['loss']:.6f} vs {first['deepspeed']['loss']:.6f}) "
            "must agree for the comparison to be fair",
        ),
        Row(
            "last_step_loss_rel_diff",
            loss_rel_diff(last),
            note=f"step {last['rep'] + 1}: dsnd {last['dsnd']['loss']:.6f}, DeepSpeed "
            f"{last['deepspeed']['loss']:.6f} (the sides train independently from step 1 on)",
        ),
    ]


def bubble_rows(raw: Mapping[str, Any]) -> list[Row]:
    reps, layout = timed(raw), raw["layout"]
    measured = median(
        bubble_fraction(rep["dsnd"]["wait_s"], rep["dsnd"]["stage_s"]) for rep in reps
    )
    p, m = layout["pp"], layout["gas"]
    theory = bubble_theory(p, m)
    serial = (p - 1) / p / theory  # every stage idle while the others compute
    return [
        Row(
            "bubble_ratio",
            measured / theory,
            BUBBLE_TARGET,
            "measured idle fraction of dsnd's 1F1B step (time blocked in receives + drain after "
            "a stage's last action, mean over stages, median over repetitions) / (p-1)/(m+p-1); "
            "target: within 2x either way, as the theory assumes equal stage times and free "
            f"messages, while fully serialised stages would read {serial:.1f}x at p={p}, m={m}",
        ),
        Row("bubble_fraction_measured", measured),
        Row("bubble_fraction_theory", theory),
    ]


def _rank_totals(per_rank: Sequence[Mapping[str, int]]) -> tuple[float, Mapping[str, int]]:
    """The largest per-rank total (the one that bounds memory) and that rank's breakdown."""
    worst = max(per_rank, key=lambda parts: sum(parts[p] for p in STATE_PARTS))
    return float(sum(worst[p] for p in STATE_PARTS)), worst


def _breakdown(parts: Mapping[str, float]) -> str:
    return " + ".join(f"{p} {parts[p]:.0f}" for p in STATE_PARTS)


def zero_rows(raw: Mapping[str, Any]) -> list[Row]:
    zero = raw["zero"]
    psi, nd = zero["psi"], zero["nd"]
    rows, measured, formula = [], {}, {}
    exact = {
        1: "4Psi params + 4Psi grads + (4 fp32 master + 8 Adam)Psi/Nd",
        3: "(4 params + 4 grads + 4 fp32 master + 8 Adam)Psi/Nd",
    }
    for stage in (1, 3):
        measured[stage], parts = _rank_totals(zero[str(stage)])
        want = zero_state_bytes(stage, psi, nd)
        formula[stage] = sum(want.values())
        rows.append(
            Row(
                f"zero{stage}_state_bytes",
                measured[stage],
                Target.near(formula[stage], ZERO_REL),
                f"per rank at dp={nd} (pp=1), Psi={psi}: measured {_breakdown(parts)}; formula "
                f"{exact[stage]} = {_breakdown(want)}",
            )
        )
    ratio = measured[3] / measured[1]
    textbook = sum(zero_state_bytes(3, psi, nd, TEXTBOOK_FP32).values()) / sum(
        zero_state_bytes(1, psi, nd, TEXTBOOK_FP32).values()
    )
    rows.insert(
        0,
        Row(
            "zero3_state_bytes_ratio",
            ratio,
            Target.near(formula[3] / formula[1], ZERO_REL),
            "ZeRO-3 / ZeRO-1 model-state bytes per rank (fp32 params + grads + fp32 master + "
            "Adam m, v; communication buckets excluded), measured after one step plus one "
            f"micro-batch backward; formula ratio at Nd={nd}: (20Psi/Nd) / (8Psi + 12Psi/Nd), "
            "as DeepSpeed keeps a separate fp32 master even for fp32 parameters (K = 12)",
        ),
    )
    rows.append(
        Row(
            "zero3_state_bytes_ratio_textbook",
            textbook,
            note="(4+4+8)Psi/Nd / (4Psi + 4Psi + 8Psi/Nd): the same accounting with the fp32 "
            "parameters as their own master (K = 8); DeepSpeed holds 4Psi/Nd more in both stages",
        )
    )
    return rows


# --- every row of the bench ------------------------------------------------------------------


def pipeline_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Every row of ``dsnd bench pipeline`` from the rank programs' raw JSON (the schedule
    phases' rows where their sections are present)."""
    rows = [*throughput_rows(raw), *bubble_rows(raw)]
    if "schedules" in raw:
        rows += schedule_rows(raw["schedules"])
    if "pp4" in raw:
        rows += schedule_rows(raw["pp4"], prefix="pp4_", compare=False)
    return rows + zero_rows(raw)
