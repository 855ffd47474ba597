"""The pure half of ``dsnd bench zero-comm`` and ``dsnd bench tp-comm``: theory and rows from
the rank program's raw JSON (`dsnd.bench.comm_rank`).

Bytes are those of `dsnd.bench.comm_count`: a collective's payload is its whole logical tensor,
and what a rank sends for it is counted as the ring algorithm's share, averaged over the group
(all-reduce 2(n-1)/n of the payload; all-gather, reduce-scatter, reduce (n-1)/n).

zero-comm: per optimizer step, the bytes each rank sends in its stage's data-parallel group ÷
those of the plain data-parallel all-reduce of the stage's gradients, 2(N-1)/N Psi (Psi: the
stage's parameter bytes, N: data-parallel ranks). ZeRO-1/2: reduce-scatter (or per-owner
reduces) of gradients plus all-gather of updated parameters, 1.0x (1.5x with DeepSpeed's default
``use_multi_rank_bucket_allreduce``, which all-reduces the gradients); ZeRO-3: reduce-scatter
plus an all-gather in forward and another in backward, 1.5x at most (1.0x where DeepSpeed keeps
a layer gathered from its forward to its backward). With pipeline stages, ZeRO-3's parameter
all-gathers per step at m=2 and m=8 micro-batches: they must not grow with m.

tp-comm: per step of one micro-batch, the tensor-parallel collectives of each layer's forward
and backward ÷ Megatron's: per transformer block, without sequence parallelism 2 all-reduces
forward (attention and MLP outputs, g) and 2 backward (their inputs' gradients, f), each of
b*s*h elements; with it 2 all-gathers and 2 reduce-scatters each way, each of b*s*h elements in
all (b*s*h/t per rank). The embedding (g after the vocabulary-parallel lookup), the head (f
before the vocabulary-parallel projection) and the vocabulary-parallel cross-entropy (an
all-reduce MAX of b*s floats and one SUM of 2*b*s) are counted apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target

ZERO_BENCH, TP_BENCH = "zero-comm", "tp-comm"
WORLDS = {"zero": 2, "zero-pp": 4, "tp": 2}
"""Ranks of each phase of the rank program (`dsnd.bench.comm_rank`)."""
EXACT = Target(1.0, 1.0, "= 1")
NONE_EXPECTED = Target(0.0, 0.0, "= 0")
ZERO_SLACK = 0.01  # ZeRO's norm and trace-check scalars: a few hundred bytes on top
ZERO_THEORY = {1: 1.0, 2: 1.0, 3: 1.5}
"""Data-parallel bytes per step ÷ the plain all-reduce's, by ZeRO stage (module docstring)."""
MULTI_RANK_THEORY = 1.5  # all-reduce of the gradients (2(N-1)/N) + all-gather of parameters
Key = tuple[str, str, str]  # (part, direction, op) of the tensor-parallel comparison


def allreduce_bytes(psi: float, n: int) -> float:
    """Bytes each of `n` ranks sends to all-reduce `psi` bytes with the ring algorithm."""
    return 2 * (n - 1) / n * psi


def zero_theory(stage: int, multi_rank: bool = False) -> float:
    """ZeRO `stage`'s data-parallel bytes per step ÷ the plain all-reduce's."""
    if multi_rank and stage in (1, 2):
        return MULTI_RANK_THEORY
    return ZERO_THEORY[stage]


def _total(summary: Sequence[Mapping[str, Any]], kind: str, field: str, op: str | None = None):
    return sum(r[field] for r in summary if r["kind"] == kind and (op is None or r["op"] == op))


def _max_rel_diff(run: Sequence[float], base: Sequence[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(run, base, strict=True))


def _stages(run: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """The first rank's record of each pipeline stage."""
    out: dict[int, Mapping[str, Any]] = {}
    for rec in run["ranks"]:
        out.setdefault(rec["stage"], rec)
    return out


# --- zero-comm -------------------------------------------------------------------------------


def dp_ratio(rec: Mapping[str, Any], dp: int) -> float:
    """A rank's data-parallel bytes sent in its last counted step ÷ the plain all-reduce's."""
    return _total(rec["steps"][-1], "dp", "sent") / allreduce_bytes(rec["psi_bytes"], dp)


def gathered(rec: Mapping[str, Any]) -> float:
    """Parameter bytes all-gathered over the data-parallel group in a step ÷ the stage's."""
    return _total(rec["steps"][-1], "dp", "payload", "all_gather") / rec["psi_bytes"]


def _breakdown(rec: Mapping[str, Any], dp: int) -> str:
    base = allreduce_bytes(rec["psi_bytes"], dp)
    parts = [
        f"{r['op']} {r['sent'] / base:.3f} ({r['calls']} calls)"
        for r in rec["steps"][-1]
        if r["kind"] == "dp" and r["sent"]
    ]
    return ", ".join(parts)


def _zero_row(name: str, run: Mapping[str, Any], target: Target, note: str) -> list[Row]:
    dp = run["layout"]["dp"]
    rows = []
    for stage, rec in sorted(_stages(run).items()):
        where = f" stage{stage}" if run["layout"]["pp"] > 1 else ""
        rows.append(
            Row(
                f"{name}{where} dp bytes / all-reduce",
                dp_ratio(rec, dp),
                target,
                f"{note}{_breakdown(rec, dp)}",
                bench=ZERO_BENCH,
            )
        )
    return rows


def _loss_row(name: str, run: Mapping[str, Any], base_name: str, base: Mapping[str, Any]) -> Row:
    diff = _max_rel_diff(run["ranks"][0]["losses"], base["ranks"][0]["losses"])
    return Row(
        f"{name} losses vs {base_name} (max rel diff)",
        diff,
        Target.at_most(LOSS_TOLERANCE),
        bench=ZERO_BENCH,
    )


ZERO_NOTES = {
    "zero3": "≤ theory: DeepSpeed keeps a layer gathered from its forward to its backward when "
    "its prefetch (stage3_prefetch_bucket_size) already covered the backward's use or the "
    "reuse is within stage3_max_reuse_distance (1e9 elements by default); ",
    "zero3-no-reuse": "stage3_max_reuse_distance and stage3_prefetch_bucket_size 0: released "
    "after forward, gathered again in backward; ",
    "zero2-multi-rank": "DeepSpeed's default use_multi_rank_bucket_allreduce=true: gradients "
    "all-reduced, not reduced to their owner; ",
}


def _zero_target(name: str, stage: int) -> Target:
    if name == "zero3":
        return Target.at_most(ZERO_THEORY[3] + ZERO_SLACK)
    centre = zero_theory(stage, multi_rank="multi-rank" in name)
    return Target.near(centre, ZERO_SLACK)


def _growth_rows(runs: Mapping[str, Any], prefix: str, what: str) -> list[Row]:
    """ZeRO-3 parameter all-gathers per step at m=8 ÷ at m=2, per stage: must not grow."""
    few, many = runs[f"{prefix}-m2"], runs[f"{prefix}-m8"]
    rows = []
    for stage, rec in sorted(_stages(few).items()):
        a, b = gathered(rec), gathered(_stages(many)[stage])
        rows.append(
            Row(
                f"{prefix} stage{stage} param all-gathers m8 / m2",
                b / a,
                Target.at_most(1.0),
                f"{what}: per step {a:.2f}x the stage's parameters at m=2, {b:.2f}x at m=8",
                bench=ZERO_BENCH,
            )
        )
    return rows


def zero_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Rows of both zero-comm phases (``zero``: pp=1 x dp=2, ``zero-pp``: pp=2 x dp=2)."""
    rows: list[Row] = []
    flat = raw["zero"]["runs"]
    for name, run in flat.items():
        stage = run["layout"]["zero"]
        rows += _zero_row(name, run, _zero_target(name, stage), ZERO_NOTES.get(name, ""))
    for name, run in flat.items():
        if name != "zero1":
            rows.append(_loss_row(name, run, "zero1", flat["zero1"]))
    pipe = raw["zero-pp"]["runs"]
    for name in ("pp2-zero1-m2", "pp2-zero2-m2"):
        stage = pipe[name]["layout"]["zero"]
        rows += _zero_row(name, pipe[name], Target.near(zero_theory(stage), ZERO_SLACK), "")
    rows += _growth_rows(pipe, "pp2-zero3", "DeepSpeed gathers each layer per micro-batch")
    rows += _growth_rows(pipe, "pp2-zero3-persist", "every parameter persistent")
    rows += _growth_rows(pipe, "pp2-zero3-keep", "parallel.reshard_after_forward=false")
    for stage, rec in sorted(_stages(pipe["pp2-zero3-persist-m2"]).items()):
        plain = _stages(pipe["pp2-zero3-m2"])[stage]
        held = rec["state"]["params"] / rec["psi_bytes"]
        rows.append(
            Row(
                f"pp2-zero3-persist stage{stage} params held / stage params",
                held,
                None,
                "parameter bytes held between steps (shard and gathered copy); plain "
                f"ZeRO-3 {plain['state']['params'] / plain['psi_bytes']:.2f}",
                bench=ZERO_BENCH,
            )
        )
    for name, run in pipe.items():
        base = "pp2-zero1-m2" if name.endswith("m2") else "pp2-zero3-m8"
        if name != base:
            rows.append(_loss_row(name, run, base, pipe[base]))
    return rows


# --- tp-comm ---------------------------------------------------------------------------------


def tp_theory(
    layers: int, activation_bytes: int, tokens: int, sequence_parallel: bool
) -> dict[Key, tuple[int, int]]:
    """(calls, payload bytes) of each (part, direction, op) in one forward and backward of one
    micro-batch through `layers` blocks, embedding, head and loss (module docstring), without
    activation checkpointing. `activation_bytes` is b*s*h elements' bytes; `tokens` b*s (the
    loss works in fp32)."""
    a = activation_bytes
    if sequence_parallel:
        theory = {
            ("block", "forward", "all_gather"): (2 * layers, 2 * layers * a),
            ("block", "forward", "reduce_scatter"): (2 * layers, 2 * layers * a),
            ("block", "backward", "all_gather"): (2 * layers, 2 * layers * a),
            ("block", "backward", "reduce_scatter"): (2 * layers, 2 * layers * a),
            ("embed", "forward", "reduce_scatter"): (1, a),
            ("embed", "backward", "all_gather"): (1, a),
            ("head", "forward", "all_gather"): (1, a),
            ("head", "backward", "reduce_scatter"): (1, a),
        }
    else:
        theory = {
            ("block", "forward", "all_reduce"): (2 * layers, 2 * layers * a),
            ("block", "backward", "all_reduce"): (2 * layers, 2 * layers * a),
            ("embed", "forward", "all_reduce"): (1, a),
            ("head", "backward", "all_reduce"): (1, a),
        }
    theory[("loss", "forward", "all_reduce")] = (2, 3 * tokens * 4)
    return theory


def part_of(label: str) -> tuple[str, str]:
    """("block", "forward") from a label such as ``forward/block3``; ("step", "") otherwise."""
    direction, _, layer = label.partition("/")
    if not layer:
        return label, ""
    return ("block" if layer.startswith("block") else layer), direction


def tp_measured(summary: Sequence[Mapping[str, Any]]) -> dict[Key, tuple[int, int]]:
    """(calls, payload) per (part, direction, op) of the tensor group's collectives, the step's
    end (``step``) left out."""
    out: dict[Key, tuple[int, int]] = {}
    for r in summary:
        part, direction = part_of(r["label"])
        if r["kind"] != "tp" or part == "step":
            continue
        calls, payload = out.get((part, direction, r["op"]), (0, 0))
        out[(part, direction, r["op"])] = (calls + r["calls"], payload + r["payload"])
    return out


def _run_theory(lay: Mapping[str, Any]) -> dict[Key, tuple[int, int]]:
    tokens = lay["micro"] * lay["seq_len"]
    activation = tokens * lay["hidden"] * lay["element_bytes"]
    return tp_theory(lay["layers"], activation, tokens, lay["sequence_parallel"])


def _step_note(summary: Sequence[Mapping[str, Any]]) -> str:
    parts = [
        f"{r['kind']} {r['op']} x{r['calls']} {r['payload']} B (sent {r['sent']:.0f})"
        for r in summary
        if r["label"] == "step"
    ]
    return "; ".join(parts) or "none"


RECOMPUTE_NOTE = (
    "includes the recomputed forward: Megatron's full recomputation repeats all the forward's "
    "collectives (2 per block); torch's checkpoint stops recomputing once backward has the "
    "tensors it needs, before the MLP's output all-reduce (1 per block)"
)


def _key_row(
    name: str,
    key: Key,
    got: tuple[int, int],
    want: tuple[int, int],
    checkpointed: bool,
    layers: int,
) -> Row:
    """One (part, direction, op) of one run against the theory without checkpointing: exact,
    except a checkpointed run's backward (context: it includes recomputation)."""
    part, direction, op = key
    blocks = f" over {layers} blocks" if part == "block" else ""
    note = f"{got[0]} calls{blocks} (theory {want[0]})"
    if not want[1]:
        return Row(
            f"{name} {part} {direction} {op} bytes (unexpected)",
            got[1],
            NONE_EXPECTED,
            note,
            bench=TP_BENCH,
        )
    recomputed = checkpointed and direction == "backward"
    if recomputed and part == "block":
        note += f"; {RECOMPUTE_NOTE}"
    return Row(
        f"{name} {part} {direction} {op} bytes / theory",
        got[1] / want[1],
        None if recomputed else EXACT,
        note,
        bench=TP_BENCH,
    )


def tp_rows(raw: Mapping[str, Any]) -> list[Row]:
    """Per run: each (part, direction, op) against Megatron's, the calls in all, and each run's
    losses against the first's."""
    rows: list[Row] = []
    runs = raw["runs"]
    for name, run in runs.items():
        lay, summary = run["layout"], run["ranks"][0]["steps"][-1]
        checkpointed = lay["activation_checkpoint_interval"] > 0
        theory, measured = _run_theory(lay), tp_measured(summary)
        for key in [*theory, *(k for k in measured if k not in theory)]:
            rows.append(
                _key_row(
                    name,
                    key,
                    measured.get(key, (0, 0)),
                    theory.get(key, (0, 0)),
                    checkpointed,
                    lay["layers"],
                )
            )
        got = sum(c for c, _ in measured.values())
        want = sum(c for c, _ in theory.values())
        note = f"{got} calls; step's end: {_step_note(summary)}"
        target = None if checkpointed else EXACT
        rows.append(
            Row(f"{name} collective calls / theory", got / want, target, note, bench=TP_BENCH)
        )
    first = next(iter(runs))
    for name, run in list(runs.items())[1:]:
        diff = _max_rel_diff(run["ranks"][0]["losses"], runs[first]["ranks"][0]["losses"])
        rows.append(
            Row(
                f"{name} losses vs {first} (max rel diff)",
                diff,
                Target.at_most(LOSS_TOLERANCE),
                bench=TP_BENCH,
            )
        )
    return rows
