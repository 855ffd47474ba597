"""``dsnd bench moe`` runs both expert paths on the same weights and tokens and refuses to
compare them unless they agree; its rows name the ratio and its target."""

from __future__ import annotations

import argparse

from dsnd.bench.moe import GROUPED_TARGET, grouped_rows
from dsnd.commands.bench import BENCHES, DEFAULT_REPS


def test_moe_bench_compares_agreeing_paths(tmp_path):
    assert BENCHES["moe"][0] == "dsnd.commands.bench:_moe" and "moe" in DEFAULT_REPS
    rows = {row.metric: row for row in grouped_rows(argparse.Namespace(steps=1, warmup=0))}
    speedup = rows["grouped_mm_speedup_8_experts"]
    assert speedup.bench == "moe" and speedup.value > 0
    assert speedup.target is not None and speedup.target.lo == GROUPED_TARGET
    assert "agree to" in speedup.note and rows["grouped_ms"].value > 0


def _ep_raw(payload_scale: float = 1.0) -> dict:
    from dsnd.bench.ep_results import a2a_theory

    lay = {
        "dp": 4,
        "micro": 2,
        "micro_batches": 2,
        "seq_len": 64,
        "hidden": 64,
        "moe_layers": 4,
        "experts": 4,
        "top_k": 2,
        "element_bytes": 4,
        "params": 1000,
        "expert_params": 800,
        "zero_stage": 1,
        "state_per_param": 8,
    }
    layouts = {f"ep{n}": {**lay, "ep": n} for n in (1, 2)}
    calls, payload = a2a_theory(layouts["ep2"], 4)
    # routing sends a rank's rows unevenly: ranks' payloads differ, their sum is the formula's
    shares = [0.1, 0.2, 0.3, 0.4]
    ranks = [
        {
            # ZeRO-1 fp32 Adam, dp=4: 4 B params + 4 B grads whole, 4 B master + 8 B moments / 4;
            # at ep=2 a rank keeps 400 of the 800 expert parameters: 200 dense + 400 its experts
            "ep1": {
                "times": [0.1, 0.3, 0.2],
                "a2a_calls": 0,
                "a2a_payload": 0,
                "other_sent": 1000.0,
                "state": {"params": 4000, "grads": 4000, "master": 1000, "optimizer": 2000},
                "losses": [5.0, 4.0],
            },
            # ZeRO's ring bytes: 1000 x (200 x 3/4 + 400 x 1/2) / (1000 x 3/4)
            "ep2": {
                "times": [0.4, 0.4, 0.5],
                "a2a_calls": calls,
                "a2a_payload": share * payload * payload_scale,
                "other_sent": 1000.0 * 350 / 750,
                "state": {"params": 2400, "grads": 2400, "master": 1000, "optimizer": 2000},
                "losses": [5.0, 4.0001],
            },
        }
        for share in shares
    ]
    return {"layouts": layouts, "ranks": ranks}


def test_ep_rows_compare_all_to_all_bytes_with_the_formula_summed_over_ranks():
    from dsnd.bench.ep_results import a2a_theory, ep_rows

    calls, payload = a2a_theory(
        {
            "ep": 2,
            "micro": 2,
            "micro_batches": 2,
            "seq_len": 64,
            "hidden": 64,
            "moe_layers": 4,
            "experts": 4,
            "top_k": 2,
            "element_bytes": 4,
        },
        4,
    )
    # 4 layers x 2 micro-batches x 4 ranks x (8 * 4 count bytes + 4 x 128 tokens x 2 x 256 B)
    assert (calls, payload) == (40, 4 * 2 * 4 * (32 + 4 * 128 * 2 * 256)) == (40, 8389632)
    assert a2a_theory({"ep": 1}, 4) == (0, 0)
    rows = {r.metric: r for r in ep_rows(_ep_raw())}
    assert rows["ep2_all_to_all_bytes_over_formula"].value == 1.0
    assert abs(rows["ep2_other_bytes_over_formula"].value - 1.0) < 1e-12
    assert rows["ep1_model_state_bytes_over_formula"].value == 1.0
    assert rows["ep2_model_state_bytes_over_formula"].value == 1.0
    assert rows["ep2_model_state_bytes_over_ep1"].value == 7800 / 11000
    assert rows["ep2_throughput_over_ep1"].value == 0.2 / 0.4  # medians of rank 0's times
    assert abs(rows["ep2_loss_rel_diff"].value - 2.5e-5) < 1e-12
    off = {r.metric: r for r in ep_rows(_ep_raw(payload_scale=1.01))}
    assert abs(off["ep2_all_to_all_bytes_over_formula"].value - 1.01) < 1e-12
