"""``dsnd bench moe`` runs both expert paths on the same weights and tokens and refuses to
compare them unless they agree; its rows name the ratio and its target."""

from __future__ import annotations

import argparse

from dsnd.bench.moe import GROUPED_TARGET, moe
from dsnd.commands.bench import BENCHES, DEFAULT_REPS


def test_moe_bench_compares_agreeing_paths(tmp_path):
    assert BENCHES["moe"][0] == "dsnd.bench.moe:moe" and "moe" in DEFAULT_REPS
    rows = {row.metric: row for row in moe(argparse.Namespace(steps=1, warmup=0), str(tmp_path))}
    speedup = rows["grouped_mm_speedup_8_experts"]
    assert speedup.bench == "moe" and speedup.value > 0
    assert speedup.target is not None and speedup.target.lo == GROUPED_TARGET
    assert "agree to" in speedup.note and rows["grouped_ms"].value > 0
