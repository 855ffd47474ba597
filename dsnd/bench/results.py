"""The pure half of ``dsnd bench pipeline``: theory, formulas, medians, targets and output rows.

The rank program (`dsnd.bench.pipeline_rank`) records raw timings and byte counts; everything
derived from them is computed here, from plain numbers, so it is unit-tested without processes.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import groupby, pairwise
from typing import Any

from dsnd.plan.schedule import (
    COMPUTE,
    FORWARD,
    RECVS,
    SENDS,
    Instr,
    StageRole,
    bubble,
    timeline,
)

BENCH = "pipeline"
WORLD = 2  # ranks: pp=2 x dp=1 for the pipeline, pp=1 x dp=2 for ZeRO
PP4_WORLD = 4  # ranks of the pp=4 schedule phase (4 ranks share this machine's cores)


def median(values: Iterable[float]) -> float:
    items = list(values)
    if not items:
        raise ValueError("median of no values")
    return float(statistics.median(items))


# --- pipeline bubble -------------------------------------------------------------------------


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

STATE_PARTS = ("params", "grads", "master", "adam")

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
    1: {"params": (4, False), "grads": (4, False), "master": (4, True), "adam": (8, True)},
    3: {"params": (4, True), "grads": (4, True), "master": (4, True), "adam": (8, True)},
}
# The same accounting with the fp32 parameters serving as the master (K = 8: m and v only):
# ZeRO-1 = 4Psi + 4Psi + 8Psi/Nd, ZeRO-3 = (4 + 4 + 8)Psi/Nd. What an fp32 optimizer that steps
# the parameters in place would hold.
TEXTBOOK_FP32: dict[int, dict[str, tuple[int, bool]]] = {
    1: {"params": (4, False), "grads": (4, False), "master": (0, True), "adam": (8, True)},
    3: {"params": (4, True), "grads": (4, True), "master": (0, True), "adam": (8, True)},
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


# --- targets and rows ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A range a metric should fall in: lo <= value <= hi (either side open when None)."""

    lo: float | None = None
    hi: float | None = None
    text: str = ""
    strict: bool = False  # hi itself is not met (value < hi)

    @classmethod
    def at_least(cls, lo: float) -> Target:
        return cls(lo=lo, text=f">= {lo:g}")

    @classmethod
    def at_most(cls, hi: float) -> Target:
        return cls(hi=hi, text=f"<= {hi:g}")

    @classmethod
    def between(cls, lo: float, hi: float) -> Target:
        return cls(lo=lo, hi=hi, text=f"{lo:g}..{hi:g}")

    @classmethod
    def near(cls, centre: float, rel: float) -> Target:
        """Within `rel` (a fraction) of `centre`."""
        lo, hi = centre * (1 - rel), centre * (1 + rel)
        return cls(lo=min(lo, hi), hi=max(lo, hi), text=f"{format_value(centre)} ±{rel:.0%}")

    @classmethod
    def below(cls, hi: float) -> Target:
        return cls(hi=hi, text=f"< {hi:g}", strict=True)

    def met(self, value: float) -> bool:
        under = self.hi is None or value < self.hi or (not self.strict and value == self.hi)
        return (self.lo is None or value >= self.lo) and under


@dataclass(frozen=True)
class Row:
    """One line of output; `target` None for a number shown for context only."""

    metric: str
    value: float
    target: Target | None = None
    note: str = ""
    bench: str = BENCH

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.value)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bench": self.bench,
            "metric": self.metric,
            "value": self.value,
            "target": None if self.target is None else self.target.text,
            "met": self.met,
        }
        if self.note:
            out["note"] = self.note
        return out


def format_value(value: float) -> str:
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 1000):
        return str(int(value))
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def json_lines(rows: Sequence[Row]) -> str:
    return "\n".join(json.dumps(row.as_json()) for row in rows)


def format_table(rows: Sequence[Row]) -> str:
    """An aligned table (bench, metric, value, target, met), then each row's note."""
    header = ("bench", "metric", "value", "target", "met")
    cells = [header]
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        target = "-" if row.target is None else row.target.text
        cells.append((row.bench, row.metric, format_value(row.value), target, met))
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    right = {2}  # numbers align right
    lines = []
    for c in cells:
        parts = [c[i].rjust(w) if i in right else c[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join(parts).rstrip())
    notes = [f"  {row.metric}: {row.note}" for row in rows if row.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


# --- from raw measurements to rows -----------------------------------------------------------

THROUGHPUT_TARGET = Target.at_least(1.0)
# 1F1B's theory assumes equal per-stage compute and free messages; dsnd's stages are balanced by
# parameter count (not time), messages cost a little and the optimizer step is not pipelined, so
# a measurement within a factor of 2 either way is the 1F1B shape. Serialised stages (no
# overlap at all) would idle ~(p - 1)/p of a step, 4.5x the theory at p=2, m=8.
BUBBLE_TARGET = Target.between(0.5, 2.0)
ZERO_REL = 0.10
LOSS_TOLERANCE = 1e-4


def _step_times(reps: Sequence[Mapping[str, Any]], side: str) -> list[float]:
    """Per repetition: the slowest rank's time (a step is done when every rank is)."""
    return [max(rep[side]["step_s"]) for rep in reps]


def timed(raw: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The repetitions after warm-up."""
    reps = [rep for rep in raw["reps"] if rep["timed"]]
    if not reps:
        raise ValueError("no timed repetitions")
    return reps


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


# --- schedules against dsnd's 1F1B -----------------------------------------------------------

BASELINE = "1f1b"
# at m >= 2p the schedule's prediction at this machine's own F/B/I/W costs should hold to 15%:
# what is left is message latency, which the prediction counts as free
SCHEDULE_BUBBLE_TARGET = Target.at_most(1.15)
SCHEDULE_THROUGHPUT_TARGET = Target.at_least(1.0)
UNIT_DIVISOR = {"1f1b": "1", "gpipe": "1", "interleaved-1f1b": "v", "zb-h1": "3"}


def unit_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble at unit costs (F = I = W = 1, B = 2; free messages), as `bubble()` computes
    it: (p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1."""
    divisor = {"1": 1, "v": v, "3": 3}[UNIT_DIVISOR[schedule]]
    return (p - 1) / (divisor * m)


def measured_bubble(span_s: Sequence[float], wait_s: Sequence[float]) -> float:
    """The bubble of one measured step, as `bubble()` defines it on a timeline: (makespan -
    busy) / busy of the busiest stage.

    `span_s[s]` is stage s's pipelined part (`pipe_s`: from the step's common barrier to the
    start of its gradient reduction, after its last compute instruction, message and tied
    exchange; the reduction and the optimizer step are outside the timeline, and a stage that
    ends first waits for the others inside the step's collectives), `wait_s[s]` the seconds of
    it blocked in receives (`pipeline_wait`). Stage s is busy for ``span - wait`` (computing,
    and sending: a send is the sender's work); makespan = the longest span, busy = the
    largest busy time. With the spans' ends aligned this is the busiest stage's
    ``pipeline_wait / (span - pipeline_wait)``.
    """
    if len(span_s) != len(wait_s) or not span_s:
        raise ValueError("need one span and one wait time per stage")
    busy = max(span - wait for span, wait in zip(span_s, wait_s, strict=True))
    if busy <= 0:
        raise ValueError(f"busy time must be > 0, got {busy}")
    return (max(span_s) - busy) / busy


def plan_programs(plan: Mapping[str, Any]) -> tuple[list[list[Instr]], list[StageRole]]:
    """The stages' programs and roles as the rank program recorded them (op, micro, chunk)."""
    programs = [[Instr(*x) for x in program] for program in plan["programs"]]
    return programs, [StageRole(**role) for role in plan["roles"]]


def op_counts(program: Sequence[Instr]) -> dict[str, int]:
    """How many instructions of each compute kind a program runs."""
    counts: dict[str, int] = {}
    for x in program:
        if x.op in COMPUTE:
            counts[x.op] = counts.get(x.op, 0) + 1
    return counts


def stage_op_costs(
    plan: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]
) -> list[dict[str, float]]:
    """Per stage, measured seconds of one compute instruction (of one chunk) of each kind it
    runs: its `op_seconds[op]` / its count of `op` instructions, median over `runs`."""
    counts = [op_counts(program) for program in plan_programs(plan)[0]]
    return [
        {op: median(run["ops"][s].get(op, 0.0) / n for run in runs) for op, n in c.items()}
        for s, c in enumerate(counts)
    ]


def op_costs(plan: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Seconds of one compute instruction per kind, for the timeline: `stage_op_costs` averaged
    over the stages that run the kind."""
    per_stage = stage_op_costs(plan, runs)
    kinds = sorted({op for costs in per_stage for op in costs}, key=COMPUTE.index)
    return {
        op: sum(costs[op] for costs in per_stage if op in costs)
        / sum(op in costs for costs in per_stage)
        for op in kinds
    }


def predicted_bubble(plan: Mapping[str, Any], cost: Mapping[str, float]) -> float:
    """The schedule's own prediction: `bubble(timeline(programs, roles, cost))`, every stage
    computing at `cost` seconds per instruction, messages free."""
    programs, roles = plan_programs(plan)
    return bubble(timeline(programs, roles, dict(cost)))


def compute_seconds(run: Mapping[str, Any]) -> float:
    """Seconds of F/B/I/W compute in one step, summed over its stages."""
    return sum(sum(ops.values()) for ops in run["ops"])


def per_micro_batch(runs: Sequence[Mapping[str, Any]], m: int) -> list[tuple[float, float]]:
    """Per stage, (forward, backward) seconds per micro-batch over all its chunks (backward: B,
    or I + W), medians over `runs`."""
    stages = range(len(runs[0]["ops"]))
    return [
        (
            median(run["ops"][s].get(FORWARD, 0.0) / m for run in runs),
            median(sum(t for op, t in run["ops"][s].items() if op != FORWARD) / m for run in runs),
        )
        for s in stages
    ]


def messages(plan: Mapping[str, Any]) -> list[int]:
    """Per stage, the sends and receives of its program."""
    return [sum(x.op in SENDS + RECVS for x in program) for program in plan_programs(plan)[0]]


STEP_PARTS = ("compute", "receive waits", "messages and dispatch", "reduce, optimizer, loss")


def step_parts(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Where the busiest stage's step goes (`STEP_PARTS`, seconds, medians over `runs`): its
    compute instructions, receive waits, the rest of its pipelined part (posting messages,
    the executor between instructions), and what follows (the gradient reduction, the
    optimizer step and sharing the loss)."""
    parts: dict[str, list[float]] = {part: [] for part in STEP_PARTS}
    for run in runs:
        busy = [span - wait for span, wait in zip(run["pipe_s"], run["wait_s"], strict=True)]
        s = busy.index(max(busy))
        compute = sum(run["ops"][s].values())
        values = (compute, run["wait_s"][s], busy[s] - compute, run["step_s"][s] - run["pipe_s"][s])
        for part, value in zip(STEP_PARTS, values, strict=True):
            parts[part].append(value)
    return {part: median(values) for part, values in parts.items()}


def _ms(costs: Mapping[str, float]) -> str:
    return ", ".join(f"{op} {seconds * 1e3:.2f}" for op, seconds in costs.items()) + " ms"


def _bubble_rows(
    name: str, prefix: str, layout: Mapping[str, Any], plan: Mapping[str, Any],
    runs: Sequence[Mapping[str, Any]], target: Target | None, why: str,
) -> list[Row]:  # fmt: skip
    p, m, v = layout["pp"], layout["micro_batches"], plan["virtual_stages"]
    measured = median(measured_bubble(run["pipe_s"], run["wait_s"]) for run in runs)
    cost = op_costs(plan, runs)
    theory = predicted_bubble(plan, cost)
    per_stage = "; ".join(f"stage {s}: {_ms(c)}" for s, c in enumerate(stage_op_costs(plan, runs)))
    divisor = UNIT_DIVISOR[name]
    unit_text = f"(p-1)/({divisor}m)" if divisor != "1" else "(p-1)/m"
    shape = f"p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    return [
        Row(
            f"{prefix}{name}_bubble_ratio",
            measured / theory,
            target,
            f"measured bubble of {name} at {shape}, {layout['model']} with {layout['layers']} "
            "blocks ((makespan - busy) / busy of the busiest stage over the pipelined part of "
            f"the step, receive waits as idle; median of {len(runs)} repetitions) / the "
            "schedule's timeline at this machine's measured costs per instruction "
            f"({_ms(cost)}: the mean over stages of {per_stage}; medians over repetitions), "
            f"messages free{why}",
        ),
        Row(f"{prefix}{name}_bubble_measured", measured),
        Row(f"{prefix}{name}_bubble_theory", theory),
        Row(
            f"{prefix}{name}_bubble_theory_unit",
            unit_bubble(name, p, m, v),
            note=f"{unit_text} at {shape}: the timeline at F = I = W = 1, B = 2",
        ),
    ]


def _parts_text(parts: Mapping[str, float]) -> str:
    return " + ".join(f"{part} {seconds * 1e3:.1f}" for part, seconds in parts.items()) + " ms"


def _versus_baseline_rows(
    name: str, layout: Mapping[str, Any], reps: Sequence[Mapping[str, Any]],
    first: Mapping[str, Any], plans: Mapping[str, Any],
) -> list[Row]:  # fmt: skip
    """Throughput, compute and first-step loss of schedule `name` against 1F1B's."""
    ours = [max(rep["runs"][name]["step_s"]) for rep in reps]
    base = [max(rep["runs"][BASELINE]["step_s"]) for rep in reps]
    compute = median(compute_seconds(rep["runs"][name]) / compute_seconds(rep["runs"][BASELINE])
                     for rep in reps)  # fmt: skip
    runs = {s: [rep["runs"][s] for rep in reps] for s in (name, BASELINE)}
    parts = {s: step_parts(runs[s]) for s in runs}
    micro = {s: per_micro_batch(runs[s], layout["micro_batches"]) for s in runs}
    per_stage = "; ".join(
        f"stage {s}: {f * 1e3:.2f} / {b * 1e3:.2f} vs {bf * 1e3:.2f} / {bb * 1e3:.2f}"
        for s, ((f, b), (bf, bb)) in enumerate(zip(micro[name], micro[BASELINE], strict=True))
    )
    sent = {s: messages(plans[s]) for s in runs}
    tokens = layout["tokens_per_step"]
    loss, base_loss = first["runs"][name]["loss"], first["runs"][BASELINE]["loss"]
    return [
        Row(
            f"{name}_throughput_vs_1f1b",
            median(b / o for b, o in zip(base, ours, strict=True)),
            SCHEDULE_THROUGHPUT_TARGET,
            f"tokens/s of {name} ({tokens / median(ours):.0f}) / dsnd 1F1B's "
            f"({tokens / median(base):.0f}), same model, weights, samples and ZeRO-1 JSON, "
            f"pp={layout['pp']}, m={layout['micro_batches']} on {layout['ranks']} ranks; median "
            f"of {len(reps)} paired repetitions in rotating order after {layout['warmup']} "
            f"warm-up. Busiest stage's step: {name} {_parts_text(parts[name])}; 1F1B "
            f"{_parts_text(parts[BASELINE])}. Sends and receives per stage: {sent[name]} vs "
            f"1F1B's {sent[BASELINE]}",
        ),
        Row(
            f"{name}_compute_vs_1f1b",
            compute,
            note="F/B/I/W seconds per step summed over stages / 1F1B's (median of paired "
            "repetitions): above 1, the schedule's instructions cost more than 1F1B's for the "
            "same work (smaller or split ops), which its smaller bubble has to pay for. Forward / "
            f"backward ms per micro-batch, {name} vs 1F1B: {per_stage}",
        ),
        Row(
            f"{name}_first_step_loss_rel_diff",
            abs(loss - base_loss) / abs(base_loss),
            Target.at_most(LOSS_TOLERANCE),
            f"same weights and samples: first-step loss {loss:.6f} vs 1F1B's {base_loss:.6f}",
        ),
    ]


def schedule_rows(section: Mapping[str, Any], prefix: str = "", compare: bool = True) -> list[Row]:
    """Rows of one schedule phase (`raw["schedules"]`, or `raw["pp4"]` with prefix "pp4_").

    With `compare`, every schedule's throughput, compute and first-step loss against 1F1B, and
    a bubble target at m >= 2p; without (ranks sharing cores, where a rank's compute slows
    whenever more ranks run than there are cores), the bubbles only, for context.
    """
    reps, layout = timed(section), section["layout"]
    p, m = layout["pp"], layout["micro_batches"]
    target = SCHEDULE_BUBBLE_TARGET if compare and m >= 2 * p else None
    why = "" if compare else f"; {layout['ranks']} ranks share {layout['cores']} cores, no target"
    rows = []
    for name, plan in section["plans"].items():
        if compare and name != BASELINE:
            rows += _versus_baseline_rows(name, layout, reps, section["reps"][0],
                                          section["plans"])  # fmt: skip
        runs = [rep["runs"][name] for rep in reps]
        rows += _bubble_rows(name, prefix, layout, plan, runs, target, why)
    return rows


def pipeline_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Every row of ``dsnd bench pipeline`` from the rank programs' raw JSON (the schedule
    phases' rows where their sections are present)."""
    rows = [*throughput_rows(raw), *bubble_rows(raw)]
    if "schedules" in raw:
        rows += schedule_rows(raw["schedules"])
    if "pp4" in raw:
        rows += schedule_rows(raw["pp4"], prefix="pp4_", compare=False)
    return rows + zero_rows(raw)


# --- partition: profile against parameters (``dsnd bench partition``) -------------------------

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
        return False, (f"NOT EVALUATED: profile chose the same boundaries as {base} "
                       f"({parts[base]}), so both runs are one program and the ratio is noise "
                       "around 1")  # fmt: skip
    if predicted[other] >= predicted[base]:
        return False, (f"NOT EVALUATED: {moved} but not its slowest stage's predicted time, so "
                       "the ratio is noise around 1")  # fmt: skip
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
