"""Memory-efficient construction: with ZeRO-3 each stage is built under deepspeed.zero.Init
over its data-parallel group, so no rank ever holds its whole stage."""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks


@pytest.mark.dist
def test_zero3_stage_is_built_partitioned(tmp_path):
    out = tmp_path / "mem"
    run_ranks(2, ["tests/distributed/zero_init_worker.py", str(out)], timeout=300)
    for rank in range(2):
        got = json.loads((tmp_path / f"mem.{rank}").read_text())
        share = got["stage_bytes"] / got["dp"]
        assert got["all_partitioned"], got
        # after construction: 1/dp of the stage (plus ZeRO's padding to a multiple of dp)
        assert share <= got["after_build_bytes"] <= share * 1.01, got
        # while building: the shards made so far plus ONE gathered layer, never the stage
        assert got["construction_peak_bytes"] <= share * 1.01 + got["largest_layer_bytes"], got
        assert got["construction_peak_bytes"] < 0.75 * got["stage_bytes"], got
