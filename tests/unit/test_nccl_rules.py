"""The NCCL-rules replay (`tests.nccl_rules.replay`) on tiny hand-written programs: what NCCL
hangs on is flagged, what it runs is not, in both of torch's modes."""

from __future__ import annotations

import pytest

from tests.nccl_rules.replay import MODES, replay


class Program:
    """One rank's record, written by hand: `send`/`recv` (async unless `wait`), collectives."""

    def __init__(self, rank: int, groups: dict[str, list[int]] | None = None) -> None:
        self.rank, self.events, self.ops = rank, [], 0
        self.groups = groups or {"0": [0, 1]}
        self.batch = None

    def _op(
        self,
        name: str,
        group: str,
        peer: int,
        nbytes: int,
        wait: bool,
        dtype: str = "torch.float32",
    ) -> int:
        op = self.ops
        self.ops += 1
        self.events.append(["op", op, name, group, peer, nbytes, dtype, self.batch, "here"])
        if wait:
            self.events.append(["wait", op])
        return op

    def send(self, peer, group="0", nbytes=64, wait=False, dtype="torch.float32"):
        return self._op("send", group, peer, nbytes, wait, dtype)

    def recv(self, peer, group="0", nbytes=64, wait=True, dtype="torch.float32"):
        return self._op("recv", group, peer, nbytes, wait, dtype)

    def collective(self, name="allreduce", group="0", nbytes=8, wait=True):
        return self._op(name, group, -1, nbytes, wait)

    def batch_of(self, *calls) -> list[int]:
        """Issue `calls` (functions taking this program) as one batch_isend_irecv, then wait
        on them all."""
        self.batch = len(self.events)
        ids = [call(self) for call in calls]
        self.batch = None
        for op in ids:
            self.events.append(["wait", op])
        return ids

    def wait(self, op: int) -> None:
        self.events.append(["wait", op])

    @property
    def record(self) -> dict:
        return {"rank": self.rank, "groups": self.groups, "events": self.events}


def run(programs, mode):
    return replay([p.record for p in programs], mode)


@pytest.mark.parametrize("mode", MODES)
def test_receive_then_send_on_both_ranks_hangs(mode):
    a, b = Program(0), Program(1)
    for me, peer in ((a, 1), (b, 0)):
        me.recv(peer)
        me.send(peer, wait=True)
    problems = run([a, b], mode)
    assert any("never gets past: wait for rank 0 op 0 recv peer 1" in p for p in problems)
    assert any("never completes: rank 1 op 0 recv" in p for p in problems)


@pytest.mark.parametrize("mode", MODES)
def test_the_same_exchange_in_one_batch_runs(mode):
    a, b = Program(0), Program(1)
    for me, peer in ((a, 1), (b, 0)):
        me.batch_of(
            lambda p, peer=peer: p.recv(peer, wait=False), lambda p, peer=peer: p.send(peer)
        )
    assert run([a, b], mode) == []


@pytest.mark.parametrize("mode", MODES)
def test_async_sends_facing_each_other_on_one_pair_hang(mode):
    """1F1B's steady state on one group: stage 0 sends an activation and stage 1 a gradient,
    both then receive. gloo (matching by tag, a thread per op) runs it; NCCL runs the pair's
    operations in order on one stream, so both sends wait for receives queued behind them."""
    a, b = Program(0), Program(1)
    for me, peer in ((a, 1), (b, 0)):
        me.send(peer)
        me.recv(peer)
    assert len(run([a, b], mode)) >= 2


@pytest.mark.parametrize("mode", MODES)
def test_one_group_per_direction_runs_the_same_exchange(mode):
    groups = {"fwd": [0, 1], "bwd": [0, 1]}
    a, b = Program(0, groups), Program(1, groups)
    a.send(1, group="fwd")
    a.recv(1, group="bwd")
    b.send(0, group="bwd")
    b.recv(0, group="fwd")
    assert run([a, b], mode) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_message_of_another_size_or_dtype_is_flagged(mode):
    a, b = Program(0), Program(1)
    a.send(1, nbytes=64, wait=True)
    b.recv(0, nbytes=32)
    a.send(1, nbytes=64, wait=True)
    b.recv(0, nbytes=64, dtype="torch.bfloat16")
    problems = run([a, b], mode)
    assert len(problems) == 2 and all("size or dtype differs" in p for p in problems)


@pytest.mark.parametrize("mode", MODES)
def test_collectives_in_another_order_on_two_groups_hang(mode):
    groups = {"0": [0, 1], "x": [0, 1]}
    a, b = Program(0, groups), Program(1, groups)
    a.collective(group="0")
    a.collective(group="x")
    b.collective(group="x")
    b.collective(group="0")
    assert any("never gets past" in p for p in run([a, b], mode))
    c, d = Program(0, groups), Program(1, groups)
    for me in (c, d):
        me.collective(group="0")
        me.collective(group="x")
    assert run([c, d], mode) == []


@pytest.mark.parametrize("mode", MODES)
def test_different_collectives_meeting_are_flagged(mode):
    a, b = Program(0), Program(1)
    a.collective("allreduce")
    b.collective("broadcast")
    a.collective("allreduce", nbytes=8)
    b.collective("allreduce", nbytes=16)
    problems = run([a, b], mode)
    assert [p.split(":")[0] for p in problems] == [
        "different collectives meet",
        "collective sizes differ",
    ]


def test_the_modes_differ_where_torch_does():
    """A batch on one side and a lone receive on the other: in the lazy mode the batch runs on
    the group's communicator and the lone receive on the pair's, so they never meet; in the
    eager mode both use the group's."""
    a, b = Program(0), Program(1)
    a.batch_of(lambda p: p.send(1))
    b.recv(0)
    assert any("never completes" in p for p in run([a, b], "lazy"))
    assert run([a, b], "eager") == []


def test_a_point_to_point_operation_waits_behind_the_groups_collective_when_eager():
    """Eager: a group's point-to-point shares its stream with its collectives. Rank 0 sends
    before an all-reduce, rank 1 receives after it: lazy runs it, eager does not."""
    a, b = Program(0), Program(1)
    a.send(1)
    a.collective()
    b.collective()
    b.recv(0)
    assert run([a, b], "lazy") == []
    assert run([a, b], "eager") != []


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        replay([], "fast")
