"""`dsnd.bench.comm_count` on 2 real gloo ranks: every collective issued inside the block is
recorded once with its op, payload, ranks and group, whether torch.distributed, DeepSpeed's comm
layer or autograd's backward issued it; nothing after the block is
(tests/distributed/comm_count_worker.py)."""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

WORLD = 2


def expected(rank: int, world: str, sub: str) -> list[tuple]:
    """(op, payload bytes, group name, sent bytes) of each call `issue` makes, in order."""
    p2p = [("send", 12, world, 12.0)] if rank == 0 else [("recv", 12, world, 0.0)]
    return [
        ("all_reduce", 32, world, 32.0),  # 8 floats: 2(n-1)/n of the payload, n = 2
        ("all_gather", 64, sub, 32.0),  # into a 16-float tensor: its output is the payload
        ("reduce_scatter", 32, world, 16.0),  # of an 8-float input
        ("all_gather", 64, sub, 32.0),  # the list form
        ("broadcast", 32, world, 16.0),
        ("all_gather", 64, world, 32.0),  # deepspeed.comm, through its stored function
        ("reduce_scatter", 32, world, 16.0),  # likewise
        ("all_reduce", 16, sub, 16.0),  # deepspeed.comm, 2 float64
        *p2p,
        ("send", 20, world, 20.0),  # batch_isend_irecv
        ("recv", 20, world, 0.0),
        ("all_reduce", 24, sub, 24.0),  # autograd: the f operator's backward
    ]


@pytest.mark.dist
def test_counter_records_every_collective_inside_its_block(tmp_path):
    out = tmp_path / "out.json"
    run_ranks(WORLD, ["tests/distributed/comm_count_worker.py", str(out)], timeout=120)
    raw = json.loads(out.read_text())
    world, sub = raw["groups"]["world"][0], raw["groups"]["sub"][0]
    assert world != sub  # two groups of the same ranks, told apart by name
    for rank, calls in enumerate(raw["calls"]):
        got = [(c["op"], c["payload"], c["group"], c["sent"]) for c in calls]
        assert got == expected(rank, world, sub), rank
        assert all(c["ranks"] == [0, 1] and c["group_size"] == 2 for c in calls)
        assert {c["label"] for c in calls} == {"inside"}
