"""`parallel.dp_shard` (hybrid sharding) and MiCS's keys: what resolves, what is refused."""

from __future__ import annotations

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from tests.config_errors import resolve_error

Z3 = "deepspeed=ds_configs/zero3.json"


@pytest.mark.parametrize(
    "sets, world, message",
    [
        (
            [Z3, "parallel.dp_shard=3"],
            4,
            "parallel.dp_shard=3 must divide the data-parallel size dp=4 (or be null or 0: shard "
            "over all of dp)",
        ),
        ([Z3, "parallel.dp_shard=8"], 4, "parallel.dp_shard=8 must divide the data-parallel "),
        ([Z3, "parallel.dp_shard=-2"], 4, "parallel.dp_shard=-2 must divide the data-parallel "),
        (
            [Z3, "parallel.pp=2", "parallel.dp_shard=4"],
            4,
            "parallel.dp_shard=4 must divide the data-parallel size dp=2",
        ),
        (
            ["deepspeed=ds_configs/zero1.json", "parallel.dp_shard=2"],
            4,
            "parallel.dp_shard=2 needs ZeRO stage 3 (shards parameters within groups of 2 ranks); ",
        ),
        (
            [Z3, "parallel.dp_shard=2", "ds.zero_optimization.zero_hpz_partition_size=2"],
            4,
            "--set ds.zero_optimization.zero_hpz_partition_size=2: zero_optimization."
            "zero_hpz_partition_size=2 and parallel.dp_shard=2 both choose where ZeRO-3 gathers ",
        ),
        (
            [Z3, "parallel.cp=2", "parallel.dp_shard=1"],
            4,
            "parallel.dp_shard=1 with parallel.cp=2 is not supported",
        ),
    ],
)
def test_bad_dp_shard_is_one_line_naming_the_key(sets, world, message):
    assert resolve_error(sets, world).startswith(message)


def test_zero1_message_names_the_json_and_its_stage():
    msg = resolve_error(["deepspeed=ds_configs/zero1.json", "parallel.dp_shard=2"], 4)
    assert msg.endswith("ds_configs/zero1.json sets zero_optimization.stage=1")


@pytest.mark.parametrize("value", ["null", "0", "4", "2", "1"])
def test_dp_shard_values_that_resolve(value):
    res = resolve(load(None, [Z3, f"parallel.dp_shard={value}"]), 4)
    assert res.run.parallel.dp_shard == (None if value == "null" else int(value))
    # the batch still counts every data-parallel rank: dp_shard changes where state lives only
    assert res.topology.dp == 4 and res.batch.train == res.batch.micro * res.batch.gas * 4


def test_dp_shard_equal_to_dp_needs_no_zero3():
    resolve(load(None, ["deepspeed=ds_configs/zero1.json", "parallel.dp_shard=2"]), 2)


@pytest.mark.parametrize("key", ["mics_shard_size", "mics_hierarchical_params_gather"])
def test_mics_keys_are_refused_by_name_pointing_at_dp_shard(key):
    value = "2" if key == "mics_shard_size" else "true"
    msg = resolve_error([Z3, f"ds.zero_optimization.{key}={value}"], 4)
    assert f"zero_optimization: '{key}' is refused: DeepSpeed 0.19.8 removed MiCS" in msg
    assert "parallel.dp_shard" in msg


def test_reshard_after_forward_false_needs_zero3():
    msg = resolve_error(
        ["deepspeed=ds_configs/zero2.json", "parallel.reshard_after_forward=false"], 2
    )
    assert msg.startswith(
        "parallel.reshard_after_forward=false needs ZeRO stage 3 (only it partitions parameters); "
    )
    assert msg.endswith("zero2.json sets zero_optimization.stage=2")
    res = resolve(load(None, [Z3, "parallel.reshard_after_forward=false"]), 2)
    assert res.run.parallel.reshard_after_forward is False
