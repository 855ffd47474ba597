"""The pure half of ``dsnd bench pipeline``: theory, formulas and its rows (the schedule phases'
rows are `dsnd.bench.schedule_results`'; medians, targets and output are `dsnd.bench.rows`).

The rank program (`dsnd.bench.pipeline_rank`) records raw timings; everything derived from them
is computed here, from plain numbers, so it is unit-tested without processes. Model-state bytes
per ZeRO stage are ``dsnd bench zero-memory``'s (`dsnd.bench.memory_results`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median, timed
from dsnd.bench.schedule_results import (
    dispatch_seconds,
    idle_fraction,
    messages,
    replay,
    replay_run,
    schedule_rows,
    stage_op_costs,
)

WORLD = 2  # ranks: pp=2 x dp=1
PP4_WORLD = 4  # ranks of the pp=4 phase (4 ranks share this machine's cores)


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


# --- throughput and bubble rows --------------------------------------------------------------


THROUGHPUT_TARGET = Target.at_least(1.10)
# (p-1)/(m+p-1) assumes equal stages and free messages; the bench also replays the step at the
# costs it measured (`bubble_rows`), which shows how much of a miss those two assumptions explain
BUBBLE_TARGET = Target.at_most(1.10)


def _step_times(reps: Sequence[Mapping[str, Any]], side: str) -> list[float]:
    """Per repetition: the slowest rank's time (a step is done when every rank is)."""
    return [max(rep[side]["step_s"]) for rep in reps]


def loss_rel_diff(rep: Mapping[str, Any]) -> float:
    ours, theirs = rep["dsnd"]["loss"], rep["deepspeed"]["loss"]
    return abs(ours - theirs) / abs(theirs)


def _ranks_note(layout: Mapping[str, Any]) -> str:
    """Where more ranks run than this machine has cores, say so."""
    ranks, cores = layout.get("ranks"), layout.get("cores")
    return f"; {ranks} ranks share {cores} cores" if ranks and cores and ranks > cores else ""


def throughput_rows(raw: Mapping[str, Any], prefix: str = "") -> list[Row]:
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
            f"{prefix}throughput_ratio",
            ratio,
            THROUGHPUT_TARGET,
            f"dsnd 1F1B tokens/s / DeepSpeed PipelineEngine (ZeRO-1) tokens/s, {shape}; median of "
            f"{len(reps)} interleaved paired repetitions after {layout['warmup']} warm-up"
            f"{_ranks_note(layout)}",
        ),
        Row(f"{prefix}dsnd_tokens_per_s", tokens / median(ours)),
        Row(f"{prefix}deepspeed_tokens_per_s", tokens / median(theirs)),
        Row(
            f"{prefix}first_step_loss_rel_diff",
            loss_rel_diff(first),
            Target.at_most(LOSS_TOLERANCE),
            "both sides start from the same weights and train on the same samples: the first "
            f"step's losses ({first['dsnd']['loss']:.6f} vs {first['deepspeed']['loss']:.6f}) "
            "must agree for the comparison to be fair",
        ),
        Row(
            f"{prefix}last_step_loss_rel_diff",
            loss_rel_diff(last),
            note=f"step {last['rep'] + 1}: dsnd {last['dsnd']['loss']:.6f}, DeepSpeed "
            f"{last['deepspeed']['loss']:.6f} (the sides train independently from step 1 on)",
        ),
    ]


def _ms(seconds: Sequence[float]) -> str:
    return "/".join(f"{x * 1e3:.2f}" for x in seconds)


def bubble_rows(
    raw: Mapping[str, Any], prefix: str = "", target: Target | None = BUBBLE_TARGET, why: str = ""
) -> list[Row]:
    """The measured bubble of dsnd's 1F1B step against (p-1)/(m+p-1) and against the step
    replayed at this run's measured costs (`_replay_rows`)."""
    reps, layout = timed(raw), raw["layout"]
    runs = [rep["dsnd"] for rep in reps]
    measured = median(bubble_fraction(run["wait_s"], run["pipe_s"]) for run in runs)
    p, m = layout["pp"], layout["gas"]
    theory = bubble_theory(p, m)
    return [
        Row(
            f"{prefix}bubble_ratio",
            measured / theory,
            target,
            "measured idle fraction of dsnd's 1F1B step over its pipelined part (from the "
            "common start to the gradient reduction: blocked in receives, or done while another "
            "stage still works; mean over stages, median over repetitions) / (p-1)/(m+p-1) at "
            f"p={p}, m={m}, which assumes equal stages and free messages{why}",
        ),
        Row(f"{prefix}bubble_fraction_measured", measured),
        Row(f"{prefix}bubble_fraction_theory", theory),
        *_replay_rows(raw["plan"], runs, raw["latency_s"], measured, prefix),
    ]


def _replay_rows(
    plan: Mapping[str, Any],
    runs: Sequence[Mapping[str, Any]],
    latency: float,
    measured: float,
    prefix: str,
) -> list[Row]:
    """The step replayed at the costs the run measured, to see how much of the bubble each
    explains: per-stage compute alone, then also each stage's own seconds per message
    (`dispatch_seconds`) and the measured one-way `latency`; and each repetition at its own
    instruction times (`replay_run`), against the `measured` idle fraction."""
    costs = stage_op_costs(plan, runs)
    dispatch = dispatch_seconds(plan, runs)
    stages = idle_fraction(replay(plan, costs))
    priced = idle_fraction(replay(plan, costs, dispatch, latency))
    own = median(idle_fraction(replay_run(plan, run, latency)) for run in runs)
    sent = messages(plan)
    per_stage = "; ".join(
        f"stage {s}: F {c['F'] * 1e3:.2f}, B {c['B'] * 1e3:.2f} ms" for s, c in enumerate(costs)
    )
    return [
        Row(
            f"{prefix}bubble_fraction_stages",
            stages,
            note="the same step replayed at each stage's measured compute per micro-batch "
            f"({per_stage}; medians), messages free: what unequal stages alone leave",
        ),
        Row(
            f"{prefix}bubble_fraction_timeline",
            priced,
            note="the replay with messages priced as measured: each stage's own time per send "
            f"or receive ({_ms(dispatch)} ms per stage, x {'/'.join(map(str, sent))} messages) "
            f"and {latency * 1e3:.3f} ms from a send to its arrival (round trip / 2 between two "
            "waiting stages)",
        ),
        Row(
            f"{prefix}bubble_fraction_replay",
            own,
            note="each repetition replayed at its own instruction times (every compute "
            "instruction and send as long as it took, receives free, the latency above; median "
            "over repetitions): with the spread of costs within a step, as stages of about equal "
            "speed wait for each other whenever one runs slow",
        ),
        Row(
            f"{prefix}bubble_ratio_replay",
            measured / own,
            note="measured / that replay: near 1 where the costs this run measured account for "
            "its bubble; above, idle from elsewhere (messages later than the latency above, "
            "the executor between instructions)",
        ),
    ]


# --- every row of the bench ------------------------------------------------------------------


def pipeline_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Every row of ``dsnd bench pipeline`` from the rank programs' raw JSON (the schedule
    phases' rows where their sections are present)."""
    rows = [*throughput_rows(raw), *bubble_rows(raw)]
    if "schedules" in raw:
        rows += schedule_rows(raw["schedules"])
    if "pp4" in raw:
        pp4 = raw["pp4"]
        why = f"{_ranks_note(pp4['layout'])}, no target"
        rows += throughput_rows(pp4, prefix="pp4_")
        rows += bubble_rows(pp4, prefix="pp4_", target=None, why=why)
        rows += schedule_rows(pp4["schedules"], prefix="pp4_", compare=False)
    return rows
