"""The pure half of the schedule phases of ``dsnd bench pipeline``: each schedule's measured
bubble against the unit-cost theory and a prediction from its measured op costs, and its step
against 1F1B's (from the rank program's raw JSON, unit-tested without processes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed
from dsnd.plan.schedule import (
    COMPUTE,
    FORWARD,
    RECVS,
    REDUCE,
    SENDS,
    STEP,
    Instr,
    StageRole,
    bubble,
    channel,
    simulate,
    timeline,
)

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


def _replay(
    programs: list[list[Instr]],
    roles: list[StageRole],
    order: list[tuple[int, Instr]],
    cost: Callable[[int, Instr], float],
    latency_s: float,
) -> list[tuple[float, float]]:
    """(span, busy) per stage of the programs run in `order` (`simulate`'s), instruction x of
    stage s taking `cost(s, x)` of its own time and a message `latency_s` from its send."""
    clock, busy = [0.0] * len(programs), [0.0] * len(programs)
    sent: dict[tuple, list[float]] = {}
    for s, x in order:
        if x.op in RECVS:
            clock[s] = max(clock[s], sent[channel(roles[s], x)].pop(0))
        spent = cost(s, x)
        clock[s] += spent
        busy[s] += spent
        if x.op in SENDS:
            sent.setdefault(channel(roles[s], x), []).append(clock[s] + latency_s)
    return list(zip(clock, busy, strict=True))


def replay(
    plan: Mapping[str, Any],
    stage_costs: Sequence[Mapping[str, float]],
    dispatch_s: Sequence[float] | None = None,
    latency_s: float = 0.0,
) -> list[tuple[float, float]]:
    """Per stage, (span, busy) of the plan's step replayed at measured costs: stage s's compute
    instructions take `stage_costs[s]` each, each of its sends and receives `dispatch_s[s]` of
    its own time, and a message arrives `latency_s` after its send (`timeline` with per-stage
    costs and priced messages; every cost 0 where not given). The span ends with the stage's
    last action; busy is its compute and dispatch."""
    programs, roles = plan_programs(plan)
    dispatch = list(dispatch_s) if dispatch_s is not None else [0.0] * len(programs)

    def cost(s: int, x: Instr) -> float:
        if x.op in COMPUTE:
            return stage_costs[s][x.op]
        return dispatch[s] if x.op in SENDS or x.op in RECVS else 0.0

    return _replay(programs, roles, simulate(programs, roles), cost, latency_s)


def replay_run(
    plan: Mapping[str, Any], run: Mapping[str, Any], latency_s: float
) -> list[tuple[float, float]]:
    """(span, busy) per stage of one measured step replayed at its own instruction times
    (`run["instr_s"]`): every compute instruction and send as long as it took, a receive its
    share of the stage's receive time less its waits (`wait_s`; the waits are what the replay
    works out), a message `latency_s` in flight, and the stage's time between instructions
    (its pipelined part, `pipe_s`, less its instructions) spread over them. Unlike `replay` at
    median costs it keeps how the costs varied within the step: stages of about equal speed
    wait for each other whenever one of them runs slow."""
    programs, roles = plan_programs(plan)
    spent: dict[tuple[int, Instr], float] = {}
    for s, program in enumerate(programs):
        pipelined = [
            (x, t)
            for x, t in zip(program, run["instr_s"][s], strict=True)
            if x.op not in (REDUCE, STEP)
        ]
        received = [t for x, t in pipelined if x.op in RECVS]
        per_recv = max(0.0, sum(received) - run["wait_s"][s]) / len(received) if received else 0.0
        between = max(0.0, run["pipe_s"][s] - sum(t for _, t in pipelined)) / len(pipelined)
        for x, t in pipelined:
            spent[s, x] = (per_recv if x.op in RECVS else t) + between

    def cost(s: int, x: Instr) -> float:
        return spent.get((s, x), 0.0)

    return _replay(programs, roles, simulate(programs, roles), cost, latency_s)


def idle_fraction(stages: Sequence[tuple[float, float]]) -> float:
    """Mean over stages of the share of the step each idles: (makespan - busy) / makespan, for
    (span, busy) per stage. With equal stages and free messages, 1F1B's (p - 1) / (m + p - 1)."""
    makespan = max(span for span, _ in stages)
    if makespan <= 0:
        raise ValueError(f"makespan must be > 0, got {makespan}")
    return sum(makespan - busy for _, busy in stages) / (len(stages) * makespan)


def dispatch_seconds(plan: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per stage, its own seconds per send or receive: what its pipelined part spent neither
    computing nor blocked in receives (posting and completing messages, the executor between
    instructions), over its messages; medians over `runs`."""
    sent = messages(plan)
    return [
        median(
            (run["pipe_s"][s] - run["wait_s"][s] - sum(run["ops"][s].values())) / n for run in runs
        )
        if n
        else 0.0
        for s, n in enumerate(sent)
    ]


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
    name: str,
    prefix: str,
    layout: Mapping[str, Any],
    plan: Mapping[str, Any],
    runs: Sequence[Mapping[str, Any]],
    target: Target | None,
    why: str,
) -> list[Row]:
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
    name: str,
    layout: Mapping[str, Any],
    reps: Sequence[Mapping[str, Any]],
    first: Mapping[str, Any],
    plans: Mapping[str, Any],
) -> list[Row]:
    """Throughput, compute and first-step loss of schedule `name` against 1F1B's."""
    ours = [max(rep["runs"][name]["step_s"]) for rep in reps]
    base = [max(rep["runs"][BASELINE]["step_s"]) for rep in reps]
    compute = median(
        compute_seconds(rep["runs"][name]) / compute_seconds(rep["runs"][BASELINE]) for rep in reps
    )
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
            rows += _versus_baseline_rows(name, layout, reps, section["reps"][0], section["plans"])
        runs = [rep["runs"][name] for rep in reps]
        rows += _bubble_rows(name, prefix, layout, plan, runs, target, why)
    return rows
