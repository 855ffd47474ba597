"""The pure half of ``dsnd bench moe``'s expert-parallel part: theory and rows from the raw JSON
of `dsnd.bench.ep_rank`.

All-to-all traffic (`dsnd.ep.experts`). Per MoE layer and micro-batch a rank of an
expert-parallel group sends, as the inputs of its all-to-alls (`dsnd.bench.comm_count`'s
payload): the E per-expert counts (int64), its own T·k (token, choice) rows of H elements
(dispatch), the R rows it received back to their senders (combine); in backward the reverse of
each: R rows (dispatch's gradient) and T·k rows (combine's gradient). R depends on the routing,
but over the group the rows received are the rows sent, so summed over all n ranks

    payload = L · m · n · (8 E + 4 T k H b)        calls per rank = 5 L m

(L MoE layers, m micro-batches, T = micro-batch tokens, b bytes per element); ep=1 has none.
The other collectives (ZeRO's) do not change with ep, nor do the model-state bytes: expert
weights stay whole tensors sharded over all of dp. Throughput at ep = n ÷ ep=1 is the median
step time of ep=1 over that of ep=n, the runs taking turns on the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsnd.bench.rows import LOSS_TOLERANCE, Row, Target, median

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


def _sum(ranks: list[Mapping[str, Any]], name: str, key: str) -> float:
    return sum(r[name][key] for r in ranks)


def _state(rec: Mapping[str, Any]) -> int:
    return sum(rec["state"].values())


def ep_rows(raw: Mapping[str, Any]) -> list[Row]:
    ranks, layouts = raw["ranks"], raw["layouts"]
    world = len(ranks)
    base = ranks[0]["ep1"]
    rows: list[Row] = []
    for name, lay in layouts.items():
        calls, payload = a2a_theory(lay, world)
        got_calls = {r[name]["a2a_calls"] for r in ranks}
        got = _sum(ranks, name, "a2a_payload")
        if lay["ep"] > 1:
            rows.append(Row(f"{name}_all_to_all_bytes_over_formula", got / payload, EXACT,
                            f"{got:,.0f} B per step over {world} ranks; calls per rank "
                            f"{sorted(got_calls)} (formula {calls})", BENCH))  # fmt: skip
        elif got:
            raise RuntimeError(f"{name}: {got} all-to-all bytes without expert parallelism")
        if name == "ep1":
            continue
        other = _sum(ranks, name, "other_sent") / _sum(ranks, "ep1", "other_sent")
        rows.append(Row(f"{name}_other_bytes_over_ep1", other, SAME,
                        "ZeRO's data-parallel traffic: unchanged by ep", BENCH))
        state = sum(_state(r[name]) for r in ranks) / sum(_state(r["ep1"]) for r in ranks)
        rows.append(Row(f"{name}_model_state_bytes_over_ep1", state, SAME,
                        "expert states stay sharded over dp, not dp/ep", BENCH))
        speed = median(base["times"]) / median(ranks[0][name]["times"])
        rows.append(Row(f"{name}_throughput_over_ep1", speed, None,
                        f"median step {1000 * median(ranks[0][name]['times']):.1f} ms against "
                        f"{1000 * median(base['times']):.1f} ms at ep=1", BENCH))  # fmt: skip
        diff = max(abs(a - b) / abs(b) for a, b in
                   zip(ranks[0][name]["losses"], base["losses"], strict=True))  # fmt: skip
        rows.append(Row(f"{name}_loss_rel_diff", diff, Target.at_most(LOSS_TOLERANCE),
                        "the same losses as ep=1, step for step", BENCH))
    return rows
