"""The pure half of ``dsnd bench moe``'s expert-parallel part: theory and rows from the raw JSON
of `dsnd.bench.ep_rank`.

All-to-all traffic (`dsnd.moe.experts`). Per MoE layer and micro-batch a rank of an
expert-parallel group sends, as the inputs of its all-to-alls (`dsnd.bench.comm_count`'s
payload): the E per-expert counts (int64), its own T·k (token, choice) rows of H elements
(dispatch), the R rows it received back to their senders (combine); in backward the reverse of
each: R rows (dispatch's gradient) and T·k rows (combine's gradient). R depends on the routing,
but over the group the rows received are the rows sent, so summed over all n ranks

    payload = L · m · n · (8 E + 4 T k H b)        calls per rank = 5 L m

(L MoE layers, m micro-batches, T = micro-batch tokens, b bytes per element); ep=1 has none. The
other collectives are ZeRO's: its ring reduce-scatter and all-gather move (n - 1)/n of what they
cover per rank of n, so with the experts apart they scale as Ψd (dp - 1)/dp + (Ψe/ep) (dp/ep -
1)/(dp/ep) (`zero_share`), ep=n's bytes ÷ ep=1's against that ratio. Model-state bytes per rank:
a rank holds experts / ep of the routed experts' parameters, ZeRO-sharded over the dp / ep ranks
holding the same experts, the dense rest over dp (`dsnd.plan.memory.model_state_bytes`, with the
gradients a dsnd step holds until its one reduction, `held_gradient_bytes`): the step's peak
measured (`dsnd.engine.memory.state_bytes`, summed over the ranks) ÷ that formula. Throughput at
ep = n ÷ ep=1 is the median step time of ep=1 over that of ep=n, the runs taking turns on the
same batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median
from dsnd.plan.memory import held_gradient_bytes, model_state_bytes

BENCH = "moe"
EXACT = Target(1.0, 1.0, "= 1")
SAME = Target.near(1.0, 0.01)


def a2a_theory(lay: Mapping[str, Any], world: int) -> tuple[int, int]:
    """(all-to-all calls per rank, payload bytes summed over `world` ranks) per step."""
    if lay["ep"] == 1:
        return 0, 0
    per = lay["moe_layers"] * lay["micro_batches"]
    tokens = lay["micro"] * lay["seq_len"]
    row = lay["hidden"] * lay["element_bytes"]
    return 5 * per, per * world * (8 * lay["experts"] + 4 * tokens * lay["top_k"] * row)


def zero_share(lay: Mapping[str, Any]) -> float:
    """ZeRO's ring traffic per rank, in parameters: the dense ones over dp ranks, a rank's
    experts over the dp / ep holding the same ones."""
    dense, experts, dp = lay["params"] - lay["expert_params"], lay["expert_params"], lay["dp"]
    held = dp // lay["ep"]
    return dense * (dp - 1) / dp + experts / lay["ep"] * (held - 1) / held


def _sum(ranks: list[Mapping[str, Any]], name: str, key: str) -> float:
    return sum(r[name][key] for r in ranks)


def _state(rec: Mapping[str, Any]) -> int:
    return sum(rec["state"].values())


def state_formula(lay: Mapping[str, Any]) -> float:
    """Model-state bytes of one rank of `lay` by the formula (the run's precision and ZeRO
    stage)."""
    bf16 = lay.get("bf16", False)
    parts = model_state_bytes(
        lay["zero_stage"],
        lay["params"],
        lay["dp"],
        bf16,
        state_bytes=lay["state_per_param"],
        experts=lay["expert_params"],
        ep=lay["ep"],
    )
    held = held_gradient_bytes(
        lay["zero_stage"],
        lay["params"],
        lay["dp"],
        bf16,
        experts=lay["expert_params"],
        ep=lay["ep"],
    )
    return sum(parts["device"].values()) + held


def _state_row(name: str, lay: Mapping[str, Any], ranks: list[Mapping[str, Any]]) -> Row:
    """The layout's model-state bytes per rank against the formula."""
    world = len(ranks)
    state = sum(_state(r[name]) for r in ranks) / (world * state_formula(lay))
    return Row(
        f"{name}_model_state_bytes_over_formula",
        state,
        SAME,
        f"{sum(_state(r[name]) for r in ranks) / world:,.0f} B per rank; "
        f"experts / {lay['ep']} over {lay['dp'] // lay['ep']} ranks, the rest "
        f"over {lay['dp']}",
        BENCH,
    )


def _a2a_rows(name: str, lay: Mapping[str, Any], ranks: list[Mapping[str, Any]]) -> list[Row]:
    """The all-to-all bytes against the formula (none at ep=1, where any is an error)."""
    world = len(ranks)
    calls, payload = a2a_theory(lay, world)
    got_calls = {r[name]["a2a_calls"] for r in ranks}
    got = _sum(ranks, name, "a2a_payload")
    if lay["ep"] > 1:
        return [
            Row(
                f"{name}_all_to_all_bytes_over_formula",
                got / payload,
                EXACT,
                f"{got:,.0f} B per step over {world} ranks; calls per rank "
                f"{sorted(got_calls)} (formula {calls})",
                BENCH,
            )
        ]
    if got:
        raise RuntimeError(f"{name}: {got} all-to-all bytes without expert parallelism")
    return []


def _against_ep1_rows(
    name: str,
    lay: Mapping[str, Any],
    ranks: list[Mapping[str, Any]],
    ep1: Mapping[str, Any],
    base: Mapping[str, Any],
) -> list[Row]:
    """ZeRO's traffic, model state, throughput and losses of ep=n against ep=1 (`ep1` its
    layout, `base` rank 0's record of it)."""
    other = _sum(ranks, name, "other_sent") / _sum(ranks, "ep1", "other_sent")
    want = zero_share(lay) / zero_share(ep1)
    state = sum(_state(r[name]) for r in ranks) / sum(_state(r["ep1"]) for r in ranks)
    speed = median(base["times"]) / median(ranks[0][name]["times"])
    diff = max(
        abs(a - b) / abs(b) for a, b in zip(ranks[0][name]["losses"], base["losses"], strict=True)
    )
    return [
        Row(
            f"{name}_other_bytes_over_formula",
            other / want,
            SAME,
            f"ZeRO's traffic {other:.4f} of ep=1's, the experts' over dp / ep ranks: "
            f"{want:.4f} by the formula",
            BENCH,
        ),
        Row(
            f"{name}_model_state_bytes_over_ep1",
            state,
            None,
            "a rank keeps its experts only",
            BENCH,
        ),
        Row(
            f"{name}_throughput_over_ep1",
            speed,
            None,
            f"median step {1000 * median(ranks[0][name]['times']):.1f} ms against "
            f"{1000 * median(base['times']):.1f} ms at ep=1",
            BENCH,
        ),
        Row(
            f"{name}_loss_rel_diff",
            diff,
            Target.at_most(LOSS_TOLERANCE),
            "the same losses as ep=1, step for step",
            BENCH,
        ),
    ]


def ep_rows(raw: Mapping[str, Any]) -> list[Row]:
    ranks, layouts = raw["ranks"], raw["layouts"]
    base = ranks[0]["ep1"]
    rows: list[Row] = []
    for name, lay in layouts.items():
        rows.append(_state_row(name, lay, ranks))
        if not name[2:].isdigit():  # another ZeRO stage or bf16 at ep=2: its model state only
            continue
        rows += _a2a_rows(name, lay, ranks)
        if name != "ep1":
            rows += _against_ep1_rows(name, lay, ranks, layouts["ep1"], base)
    return rows
