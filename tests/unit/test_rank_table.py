"""Rank table: topology coordinates joined with launch placement, and its text form."""

from __future__ import annotations

import pytest

from dsnd.launcher.command_lines import placement
from dsnd.launcher.hostfile import parse_hostfile_text, select_slots
from dsnd.launcher.rank_table import format_rank_table, rank_rows
from dsnd.topology import Topology

COLS = ("rank", "host", "local_rank", "pp", "dp", "cp", "tp")


def rows_as_tuples(rows: list[dict]) -> list[tuple]:
    assert all(tuple(row) == COLS for row in rows)  # exactly these keys, in this order
    return [tuple(row[c] for c in COLS) for row in rows]


def test_pp2_tp2_on_two_hosts_of_two():
    rows = rank_rows(Topology(pp=2, dp=1, tp=2), [("h1", 0), ("h1", 1), ("h2", 0), ("h2", 1)])
    assert rows_as_tuples(rows) == [
        (0, "h1", 0, 0, 0, 0, 0),
        (1, "h1", 1, 0, 0, 0, 1),
        (2, "h2", 0, 1, 0, 0, 0),
        (3, "h2", 1, 1, 0, 0, 1),
    ]
    assert format_rank_table(rows) == (
        "rank  host  local_rank  pp  dp  cp  tp\n"
        "   0  h1             0   0   0   0   0\n"
        "   1  h1             1   0   0   0   1\n"
        "   2  h2             0   1   0   0   0\n"
        "   3  h2             1   1   0   0   1"
    )


@pytest.mark.parametrize(
    "include, exclude",
    [("h1:1,3@h2:0,2", None), (None, "h1:0,2@h2:1,3"), ("h2:2,0@h1:3,1", None)],
)
def test_two_of_four_slots_per_host_via_filters(include, exclude):
    hosts = parse_hostfile_text("h1 slots=4\nh2 slots=4\n", "hf")
    slots = select_slots(hosts, include, exclude)
    rows = rank_rows(Topology(pp=2, dp=1, tp=2), placement(slots))
    # local_rank indexes the selected slots (DeepSpeed narrows CUDA_VISIBLE_DEVICES to them).
    assert rows_as_tuples(rows) == [
        (0, "h1", 0, 0, 0, 0, 0),
        (1, "h1", 1, 0, 0, 0, 1),
        (2, "h2", 0, 1, 0, 0, 0),
        (3, "h2", 1, 1, 0, 0, 1),
    ]


def test_pp2_dp2_tp2_on_two_hosts_of_four():
    place = [("a", i) for i in range(4)] + [("b", i) for i in range(4)]
    rows = rank_rows(Topology(pp=2, dp=2, tp=2), place)
    assert [(r["host"], r["pp"], r["dp"], r["tp"]) for r in rows] == [
        ("a", 0, 0, 0),
        ("a", 0, 0, 1),
        ("a", 0, 1, 0),
        ("a", 0, 1, 1),
        ("b", 1, 0, 0),
        ("b", 1, 0, 1),
        ("b", 1, 1, 0),
        ("b", 1, 1, 1),
    ]


def test_format_widens_columns_for_long_values():
    place = [("node-long-name", i) for i in range(12)]
    table = format_rank_table(rank_rows(Topology(pp=1, dp=12, tp=1), place))
    lines = table.splitlines()
    assert lines[0] == "rank  host            local_rank  pp  dp  cp  tp"
    assert lines[1] == "   0  node-long-name           0   0   0   0   0"
    assert lines[12] == "  11  node-long-name          11   0  11   0   0"
    assert len(lines) == 13
    assert format_rank_table([]) == "rank  host  local_rank  pp  dp  cp  tp"


def test_context_parallel_peers_sit_between_data_and_tensor_peers():
    rows = rank_rows(Topology(pp=1, dp=2, tp=2, cp=2), [("a", i) for i in range(8)])
    assert [(r["dp"], r["cp"], r["tp"]) for r in rows] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="placement has 3 ranks but topology .* has 4"):
        rank_rows(Topology(pp=2, dp=1, tp=2), [("h", 0), ("h", 1), ("h", 2)])
