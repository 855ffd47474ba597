"""Pipeline schedules as pure data: compute orders, whole programs, cross-stage simulation,
time, DeepSpeed and Megatron parity.

No processes: `simulate` stands in for the ranks. The dependency check on its output, the
Megatron interleaved order and the message channels are written here independently of
`dsnd.plan.schedule`, so a bug in `simulate` (or in `channel`) cannot hide one in a schedule.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from dsnd.plan.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE,
    FORWARD,
    OPS,
    RECVS,
    SCHEDULES,
    SENDS,
    Instr,
    StageRole,
    bubble,
    chart,
    compute_order,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    program,
    simulate,
    timeline,
    zb_h1,
)

ALL_PP = range(1, 9)
ALL_M = range(1, 33)
BUILDERS = [one_f_one_b, gpipe, interleaved_1f1b, zb_h1]

_WORD = re.compile(r"([A-Za-z_]+?)(\d+)?(?:\.(\d+))?")


def parse(text: str) -> list[Instr]:
    """ "F0 F1.1 send_act1.1 step" -> [Instr("F", 0), Instr("F", 1, 1), ..., Instr("step")]."""
    out = []
    for word in text.split():
        op, micro, chunk = _WORD.fullmatch(word).groups()
        out.append(Instr(op, int(micro) if micro else -1, int(chunk) if chunk else 0))
    return out


def show(instrs: list[Instr]) -> str:
    return " ".join(str(x) for x in instrs)


def roles_for(p: int, v: int = 1, ties: bool = False, sp_sum: bool = False) -> list[StageRole]:
    """Stage 0 owns the tied weight (the embedding), the last stage borrows it (the head)."""

    def tie(s: int) -> str | None:
        if not ties:
            return None
        return "owner" if s == 0 else "borrower" if s == p - 1 else None

    return [StageRole(s, p, v, tie=tie(s), sp_sum=sp_sum) for s in range(p)]


def programs_for(
    name: str, p: int, m: int, v: int = 1, ties: bool = False, sp_sum: bool = False
) -> tuple[list[list[Instr]], list[StageRole]]:
    roles = roles_for(p, v, ties, sp_sum)
    return [program(compute_order(name, p, s, m, v), roles[s]) for s in range(p)], roles


# ---- Instr ------------------------------------------------------------------------------------


def test_instr_prints_as_op_micro_and_odd_chunk():
    assert str(Instr("F", 3)) == "F3"
    assert str(Instr("B", 0)) == "B0"
    assert str(Instr("F", 3, 1)) == "F3.1"
    assert str(Instr("W", 2, 0)) == "W2"  # chunk 0 is left out
    assert str(Instr("send_act", 2, 1)) == "send_act2.1"
    assert str(Instr("recv_grad", 0)) == "recv_grad0"
    assert str(Instr("step")) == "step"
    assert str(Instr("tied_lend")) == "tied_lend"
    assert parse("F3 B0 F1.2 reduce") == [
        Instr("F", 3),
        Instr("B", 0),
        Instr("F", 1, 2),
        Instr("reduce"),
    ]
    assert show(parse("F0 send_act0.1 recv_grad12.3 sp_sum step")) == (
        "F0 send_act0.1 recv_grad12.3 sp_sum step"
    )


def test_instr_is_frozen_and_hashable():
    x = Instr("F", 1)
    assert x == Instr("F", 1, 0) and hash(x) == hash(Instr("F", 1, 0))
    assert x != Instr("F", 1, 1) and x != Instr("B", 1)
    assert len({Instr("F", 1), Instr("F", 1), Instr("F", 1, 1)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.micro = 2
    assert (Instr("step").micro, Instr("step").chunk) == (-1, 0)


@pytest.mark.parametrize(
    ("op", "micro", "chunk"),
    [
        ("X", 0, 0),
        ("f", 0, 0),
        ("forward", 0, 0),
        ("", 0, 0),
        ("F", 0, -1),
        ("send_act", 0, -1),
        ("F", -1, 0),
        ("B", -1, 0),
        ("I", -1, 0),
        ("W", -1, 1),
    ],
)
def test_instr_rejects_bad_fields(op, micro, chunk):
    with pytest.raises(ValueError):
        Instr(op, micro, chunk)


def test_instr_unknown_op_message_lists_the_ops():
    with pytest.raises(ValueError, match=r"unknown instruction 'X'; expected one of F, B, I, W, "):
        Instr("X", 0)
    with pytest.raises(ValueError, match=r"^bad micro-batch/chunk for F: -1, 0$"):
        Instr("F")
    with pytest.raises(ValueError, match=r"^bad micro-batch/chunk for recv_act: -1, 0$"):
        Instr("recv_act")  # a message belongs to a micro-batch
    # the tied exchange and the step's end go without one
    whole_step = [op for op in OPS if op not in (*COMPUTE, *SENDS, *RECVS)]
    assert [str(Instr(op)) for op in whole_step] == whole_step


# ---- the compute_order() front door and bad arguments -----------------------------------------


def test_compute_order_dispatches_by_name():
    assert compute_order("1f1b", 4, 1, 6) == one_f_one_b(4, 1, 6)
    assert compute_order("gpipe", 4, 1, 6) == gpipe(4, 1, 6)
    assert compute_order("zb-h1", 4, 1, 6) == zb_h1(4, 1, 6)
    assert compute_order("interleaved-1f1b", 4, 1, 8, 2) == interleaved_1f1b(4, 1, 8, 2)
    assert compute_order("interleaved-1f1b", 4, 1, 8, 3) == interleaved_1f1b(4, 1, 8, 3)
    assert sorted(SCHEDULES) == ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"]


def test_unknown_schedule_name_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError) as e:
        compute_order("1F1B", 2, 0, 4)
    assert str(e.value) == (
        "unknown pipeline schedule '1F1B'; "
        "expected one of '1f1b', 'gpipe', 'interleaved-1f1b', 'zb-h1'"
    )


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 0, 4), r"^stages, micro-batches and chunks must be >= 1, got 0, 4, "),
        ((4, 4, 4), r"^stage must be in \[0, 4\), got 4$"),
        ((4, -1, 4), r"^stage must be in \[0, 4\), got -1$"),
        ((4, 0, 0), r"^stages, micro-batches and chunks must be >= 1, got 4, 0, "),
    ],
)
def test_bad_arguments_are_value_errors(build, args, message):
    with pytest.raises(ValueError, match=message):
        build(*args)


@pytest.mark.parametrize("build", BUILDERS)
def test_zero_chunks_is_a_value_error(build):
    with pytest.raises(
        ValueError,
        match=r"^stages, micro-batches and chunks must be >= 1, "
        r"got 4, 4, 0$",
    ):
        build(4, 0, 4, 0)


@pytest.mark.parametrize(
    ("build", "name"), [(one_f_one_b, "1f1b"), (gpipe, "gpipe"), (zb_h1, "zb-h1")]
)
def test_single_chunk_schedules_refuse_chunks(build, name):
    with pytest.raises(ValueError) as e:
        build(4, 0, 8, 2)
    assert str(e.value) == f"the {name} schedule runs one model chunk per stage, got 2"
    with pytest.raises(ValueError):
        compute_order(name, 4, 0, 8, 2)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 6), (4, 2), (3, 1), (3, 8)])
def test_interleaved_needs_micro_batches_a_multiple_of_stages(p, m):
    with pytest.raises(ValueError) as e:
        interleaved_1f1b(p, 0, m, 2)
    assert str(e.value) == (f"interleaved 1F1B needs micro-batches ({m}) divisible by stages ({p})")


# ---- golden lists -----------------------------------------------------------------------------


def test_one_f_one_b_golden_four_stages_six_micro():
    # warm-up of 3, 2, 1, 0 forwards; steady F/B pairs; cool-down of the warm-up's backwards
    assert [show(one_f_one_b(4, s, 6)) for s in range(4)] == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_gpipe():
    # warm-up = min(stages - stage - 1, micro) swallows every forward on the early stages
    assert show(one_f_one_b(4, 0, 2)) == "F0 F1 B0 B1"
    assert show(one_f_one_b(4, 2, 2)) == "F0 F1 B0 B1"
    assert show(one_f_one_b(4, 3, 2)) == "F0 B0 F1 B1"


def test_gpipe_golden():
    assert show(gpipe(3, 1, 4)) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_single_stage_alternates():
    assert show(one_f_one_b(1, 0, 3)) == "F0 B0 F1 B1 F2 B2"


def test_interleaved_golden_two_stages_four_micro_two_chunks():
    # warm-up 2 (p - s - 1) + (v - 1) p = 4, 2; rounds of p = 2 micro-batches per chunk
    assert [show(interleaved_1f1b(2, s, 4, 2)) for s in range(2)] == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ]


def test_interleaved_golden_four_stages_eight_micro_two_chunks():
    # warm-up of 10, 8, 6, 4 forwards
    assert [show(interleaved_1f1b(4, s, 8, 2)) for s in range(4)] == [
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 "
        "F6.1 B0 F7.1 B1 B2 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 B0.1 F5 B1.1 F6 B2.1 F7 B3.1 "
        "F4.1 B0 F5.1 B1 F6.1 B2 F7.1 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4 B2.1 F5 B3.1 "
        "F6 B0 F7 B1 F4.1 B2 F5.1 B3 F6.1 B4.1 F7.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 "
        "F4 B0 F5 B1 F6 B2 F7 B3 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4 B5 B6 B7",
    ]


def test_interleaved_with_as_many_micro_batches_as_stages_is_all_forwards_first():
    # Megatron: num_microbatches == pipeline size -> every forward is warm-up
    for s in range(3):
        assert show(interleaved_1f1b(3, s, 3, 2)) == (
            "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 B1.1 B2.1 B0 B1 B2"
        )


def test_zb_h1_golden_four_stages_six_micro():
    # 1F1B with B split into I and W; stage s keeps up to s weight gradients pending
    assert [show(zb_h1(4, s, 6)) for s in range(4)] == [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5",
        "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5",
    ]


# ---- Megatron's interleaved schedule, re-implemented here -------------------------------------


def megatron_interleaved(p: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """(op, micro, chunk) in the order of Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` (forward k / backward k of the stage)."""
    total = m * v
    group = p * v

    def model_chunk_id(k: int, forward: bool) -> int:
        in_group = k % group
        chunk = in_group // p
        return chunk if forward else v - chunk - 1

    def microbatch_id_in_model_chunk(k: int) -> int:
        return (k // group) * p + k % p

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", microbatch_id_in_model_chunk(k), model_chunk_id(k, True))

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", microbatch_id_in_model_chunk(k), model_chunk_id(k, False))

    if m == p:
        num_warmup = total
    else:
        num_warmup = (p - rank - 1) * 2 + (v - 1) * p
        num_warmup = min(num_warmup, total)
    num_steady = total - num_warmup
    out = [fwd(k) for k in range(num_warmup)]
    for k in range(num_steady):
        out.append(fwd(k + num_warmup))
        out.append(bwd(k))
    for k in range(num_steady, total):
        out.append(bwd(k))
    return out


def test_interleaved_equals_megatron_and_runs_every_chunk_once():
    for p in range(1, 7):
        for m in range(p, 4 * p + 1, p):
            for v in (1, 2, 3, 4):
                for s in range(p):
                    ours = interleaved_1f1b(p, s, m, v)
                    where = f"p={p} m={m} v={v} s={s}: {show(ours)}"
                    assert [(x.op, x.micro, x.chunk) for x in ours] == megatron_interleaved(
                        p, s, m, v
                    ), where
                    units = [(i, c) for i in range(m) for c in range(v)]
                    forwards = [(x.micro, x.chunk) for x in ours if x.op == FORWARD]
                    backwards = [(x.micro, x.chunk) for x in ours if x.op == BACKWARD]
                    assert sorted(forwards) == units and sorted(backwards) == units, where
                    assert len(ours) == 2 * m * v, where
                    at = {x: i for i, x in enumerate(ours)}
                    assert all(
                        at[Instr(FORWARD, i, c)] < at[Instr(BACKWARD, i, c)] for i, c in units
                    ), where


# ---- per-stage properties, every (pp, m) ------------------------------------------------------


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_one_chunk_schedule_properties(name):
    # every (pp, m) inside one item: hundreds of cases without their pytest overhead
    for pp in ALL_PP:
        for m in ALL_M:
            for stage in range(pp):
                instrs = compute_order(name, pp, stage, m)
                where = f"{name} pp={pp} m={m} stage={stage}: {show(instrs)}"
                forwards = [x.micro for x in instrs if x.op == FORWARD]
                backwards = [x.micro for x in instrs if x.op == BACKWARD]
                # each micro-batch forwarded once and backwarded once, both in order
                assert forwards == list(range(m)) and backwards == list(range(m)), where
                assert len(instrs) == 2 * m and all(x.chunk == 0 for x in instrs), where
                # ... and its forward comes first on this stage
                at = {x: i for i, x in enumerate(instrs)}
                assert all(at[Instr(FORWARD, i)] < at[Instr(BACKWARD, i)] for i in range(m)), where
                expected = min(pp - stage, m) if name == "1f1b" else m
                assert max_in_flight(instrs) == expected, where


def test_zb_h1_properties():
    for pp in range(1, 9):
        for m in range(1, 25):
            peak_1f1b = max(max_in_flight(one_f_one_b(pp, s, m)) for s in range(pp))
            assert peak_1f1b == min(pp, m)
            for stage in range(pp):
                instrs = zb_h1(pp, stage, m)
                where = f"zb-h1 pp={pp} m={m} stage={stage}: {show(instrs)}"
                assert {x.op for x in instrs} == {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}, where
                assert len(instrs) == 3 * m and all(x.chunk == 0 for x in instrs), where
                at = {x: i for i, x in enumerate(instrs)}
                assert len(at) == 3 * m, where  # F, I, W once each per micro-batch
                for i in range(m):
                    f, b, w = (at[Instr(op, i)] for op in "FIW")
                    assert f < b < w, where
                # F and I run in 1F1B's order of F and B
                f_and_i = [(x.op.replace("I", "B"), x.micro) for x in instrs if x.op != "W"]
                assert f_and_i == [(x.op, x.micro) for x in one_f_one_b(pp, stage, m)], where
                # a pending W keeps its activations: still no more than 1F1B's stage-0 peak
                assert max_in_flight(instrs) <= pp, where
                assert max_in_flight(instrs) <= peak_1f1b, where


def test_one_f_one_b_stashes_less_than_gpipe_once_micro_batches_outnumber_stages():
    assert [max_in_flight(one_f_one_b(4, s, 16)) for s in range(4)] == [4, 3, 2, 1]
    assert [max_in_flight(gpipe(4, s, 16)) for s in range(4)] == [16] * 4
    assert [max_in_flight(zb_h1(4, s, 16)) for s in range(4)] == [4, 4, 4, 4]


def test_max_in_flight_counts_forwarded_not_yet_finished():
    assert max_in_flight([]) == 0
    assert max_in_flight(parse("F0 B0 F1 B1")) == 1
    assert max_in_flight(parse("F0 F1 B0 F2 B1 B2")) == 2
    # with B split, a micro-batch is finished by its W, not its I
    assert max_in_flight(parse("F0 I0 F1 I1 W0 W1")) == 2
    assert max_in_flight(parse("F0 I0 W0 F1 I1 W1")) == 1
    # chunks count separately
    assert max_in_flight(parse("F0 F0.1 B0.1 B0")) == 2
    # communication does not count
    assert max_in_flight(parse("recv_act0 F0 send_act0 recv_grad0 B0 send_grad0 reduce step")) == 1


# ---- program() --------------------------------------------------------------------------------


def test_program_golden_one_f_one_b_two_stages_with_ties_and_sp_sum():
    roles = roles_for(2, ties=True, sp_sum=True)
    assert roles[0].tie == "owner" and roles[1].tie == "borrower"
    assert [show(program(one_f_one_b(2, s, 2), roles[s])) for s in range(2)] == [
        "tied_lend F0 send_act0 F1 send_act1 recv_grad0 B0 recv_grad1 B1 "
        "tied_add sp_sum reduce step",
        "tied_borrow recv_act0 F0 B0 send_grad0 recv_act1 F1 B1 send_grad1 "
        "tied_return sp_sum reduce step",
    ]


def test_program_golden_plain():
    roles = roles_for(2)
    assert [show(program(one_f_one_b(2, s, 2), roles[s])) for s in range(2)] == [
        "F0 send_act0 F1 send_act1 recv_grad0 B0 recv_grad1 B1 reduce step",
        "recv_act0 F0 B0 send_grad0 recv_act1 F1 B1 send_grad1 reduce step",
    ]
    assert show(program(one_f_one_b(1, 0, 2), StageRole(0, 1))) == "F0 B0 F1 B1 reduce step"


def test_program_golden_interleaved_and_zero_bubble():
    roles = roles_for(2, v=2)
    # chunk 1 of stage 0 is virtual stage 2: it receives from stage 1's chunk 0
    assert show(program(interleaved_1f1b(2, 0, 2, 2), roles[0])) == (
        "F0 send_act0 F1 send_act1 recv_act0.1 F0.1 send_act0.1 recv_act1.1 F1.1 send_act1.1 "
        "recv_grad0.1 B0.1 send_grad0.1 recv_grad1.1 B1.1 send_grad1.1 "
        "recv_grad0 B0 recv_grad1 B1 reduce step"
    )
    # the last virtual stage (stage 1, chunk 1) neither receives gradients nor sends activations
    assert show(program(interleaved_1f1b(2, 1, 2, 2), roles[1])) == (
        "recv_act0 F0 send_act0 recv_act1 F1 send_act1 recv_act0.1 F0.1 recv_act1.1 F1.1 "
        "B0.1 send_grad0.1 B1.1 send_grad1.1 recv_grad0 B0 send_grad0 recv_grad1 B1 send_grad1 "
        "reduce step"
    )
    roles = roles_for(2, ties=True)
    assert [show(program(zb_h1(2, s, 2), roles[s])) for s in range(2)] == [
        "tied_lend F0 send_act0 F1 send_act1 recv_grad0 I0 W0 recv_grad1 I1 W1 tied_add "
        "reduce step",
        "tied_borrow recv_act0 F0 I0 send_grad0 recv_act1 F1 I1 send_grad1 W0 W1 tied_return "
        "reduce step",
    ]


def check_program(compute: list[Instr], role: StageRole, prog: list[Instr], where: str) -> None:
    """`prog` is `compute` with, around each compute instruction, exactly the receive before and
    the send after that its virtual stage needs, and the tied / sp / reduce / step frame."""
    p, v = role.stages, role.chunks
    last = p * v - 1
    frame = {"owner": ("tied_lend", "tied_add"), "borrower": ("tied_borrow", "tied_return")}
    comm = ("recv_act", "send_act", "recv_grad", "send_grad")
    assert [x for x in prog if x.op in COMPUTE] == compute, where
    head = [frame[role.tie][0]] if role.tie else []
    tail = (["sp_sum"] if role.sp_sum else []) + ["reduce", "step"]
    assert [x.op for x in prog[: len(head)]] == head, where
    assert [x.op for x in prog[len(prog) - len(tail) :]] == tail, where
    body = prog[len(head) : len(prog) - len(tail)]
    if role.tie:
        assert body[-1].op == frame[role.tie][1], where
        body = body[:-1]
        # the tied gradient goes (or is added) right after the last B / W and its send
        grads = [i for i, x in enumerate(body) if x.op in ("B", "W")]
        after = body[grads[-1] + 1 :]
        assert after in ([], [Instr("send_grad", body[grads[-1]].micro, body[grads[-1]].chunk)]), (
            where
        )
    for x in prog:
        assert (
            x.op
            not in (
                "tied_lend",
                "tied_add",
                "tied_borrow",
                "tied_return",
                "sp_sum",
                "reduce",
                "step",
            )
            or prog.count(x) == 1
        ), where
    expected: list[Instr] = []
    for x in compute:
        vs = x.chunk * p + role.stage
        before, after = [], []
        if x.op == "F":
            before = [Instr("recv_act", x.micro, x.chunk)] if vs > 0 else []
            after = [Instr("send_act", x.micro, x.chunk)] if vs < last else []
        elif x.op in ("B", "I"):
            before = [Instr("recv_grad", x.micro, x.chunk)] if vs < last else []
            after = [Instr("send_grad", x.micro, x.chunk)] if vs > 0 else []
        expected += before + [x] + after
    assert [x for x in body if x.op in COMPUTE or x.op in comm] == expected, where
    assert all(x.op in COMPUTE or x.op in comm for x in body), where


# ---- simulate over every schedule -------------------------------------------------------------


def check_simulated_order(
    programs: list[list[Instr]], roles: list[StageRole], order: list[tuple[int, Instr]]
) -> None:
    """Every stage ran its own program in its order, and every instruction after what it needs.

    Written without `dsnd.plan.schedule.channel`: the neighbour of virtual stage vs = c p + s
    is vs +- 1, held by rank (vs +- 1) mod p as chunk (vs +- 1) // p."""
    pp = len(programs)
    p, v = roles[0].stages, roles[0].chunks
    last = p * v - 1
    assert [[x for s, x in order if s == stage] for stage in range(pp)] == programs
    seen: set[tuple[int, Instr]] = set()
    unreceived: dict[tuple[str, int], list[int]] = {}  # (kind, receiving vs) -> micros in flight
    steps = [i for i, (_, x) in enumerate(order) if x.op == "step"]
    assert len(steps) == pp
    assert all(x.op == "step" for _, x in order[steps[0] :]), "a stage ran on after a step"
    for stage, x in order:
        vs = x.chunk * p + stage
        needs: list[tuple[int, Instr]] = []
        if x.op in ("send_act", "send_grad"):
            to = vs + 1 if x.op == "send_act" else vs - 1
            assert 0 <= to <= last, (stage, x)
            unreceived.setdefault((x.op[5:], to), []).append(x.micro)
        elif x.op in ("recv_act", "recv_grad"):
            frm = vs - 1 if x.op == "recv_act" else vs + 1
            assert 0 <= frm <= last, (stage, x)
            send = Instr(x.op.replace("recv", "send"), x.micro, frm // p)
            needs.append((frm % p, send))
            queue = unreceived.get((x.op[5:], vs), [])
            assert queue and queue[0] == x.micro, f"stage {stage} ran {x} with {queue} in flight"
            queue.pop(0)
        elif x.op == "F":
            needs += [(stage, Instr("recv_act", x.micro, x.chunk))] if vs > 0 else []
        elif x.op in ("B", "I"):
            needs.append((stage, Instr("F", x.micro, x.chunk)))
            needs += [(stage, Instr("recv_grad", x.micro, x.chunk))] if vs < last else []
        elif x.op == "W":
            needs.append((stage, Instr("I", x.micro, x.chunk)))
        for need in needs:
            assert need in seen, f"stage {stage} ran {x} before {need}"
        assert (stage, x) not in seen, f"stage {stage} ran {x} twice"
        seen.add((stage, x))
    assert all(not q for q in unreceived.values()), unreceived
    # a tied exchange is a rendezvous: the two sides run with nothing of theirs in between
    for a, b in (("tied_lend", "tied_borrow"), ("tied_return", "tied_add")):
        at = [i for i, (_, x) in enumerate(order) if x.op in (a, b)]
        if not at:
            continue
        assert len(at) == 2 and {order[i][1].op for i in at} == {a, b}
        sides = {order[i][0] for i in at}
        assert not [s for s, _ in order[at[0] + 1 : at[1]] if s in sides], (a, b)


def grid():
    """(name, pp, m, v) over every schedule: pp 1..6, m 1..12; interleaved with v 2, 3, m a
    multiple of pp and pp >= 2."""
    for name in SCHEDULES:
        for pp in range(1, 7):
            for m in range(1, 13):
                if name == "interleaved-1f1b":
                    if pp >= 2 and m % pp == 0:
                        yield from ((name, pp, m, v) for v in (2, 3))
                else:
                    yield name, pp, m, 1


@pytest.mark.parametrize("ties", [False, True], ids=["plain", "tied+sp"])
def test_simulate_every_schedule(ties):
    count = 0
    for name, pp, m, v in grid():
        if ties and pp < 2:
            continue
        programs, roles = programs_for(name, pp, m, v, ties=ties, sp_sum=ties)
        for s in range(pp):
            where = f"{name} pp={pp} m={m} v={v} stage={s}"
            check_program(compute_order(name, pp, s, m, v), roles[s], programs[s], where)
        order = simulate(programs, roles)
        check_simulated_order(programs, roles, order)
        count += 1
    assert count == (214 if ties else 250)  # the whole grid ran


def test_simulate_runs_stages_in_lock_step_ticks():
    # a message is visible to its receiver from the next tick on; the step waits for everyone
    programs, roles = programs_for("1f1b", 2, 2)
    order = simulate(programs, roles)
    assert [f"{s}:{x}" for s, x in order] == [
        "0:F0",  # tick 0: stage 1 waits for micro 0's activation
        "0:send_act0",
        "0:F1",
        "1:recv_act0",
        "0:send_act1",
        "1:F0",
        "1:B0",  # stage 0 waits for B0's gradient
        "1:send_grad0",
        "0:recv_grad0",
        "1:recv_act1",
        "0:B0",
        "1:F1",
        "1:B1",
        "1:send_grad1",
        "0:recv_grad1",
        "1:reduce",
        "0:B1",  # stage 1 waits at its step for stage 0
        "0:reduce",
        "0:step",
        "1:step",
    ]


def test_simulate_of_nothing_is_nothing():
    assert simulate([], []) == []
    assert simulate([[], []], roles_for(2)) == []


# ---- simulate catches broken programs ---------------------------------------------------------


def test_receives_out_of_order_are_caught():
    programs, roles = programs_for("gpipe", 2, 2)
    assert show(programs[1][:4]) == "recv_act0 F0 recv_act1 F1"
    programs[1][0], programs[1][2] = programs[1][2], programs[1][0]
    assert deadlock(programs, roles) == (
        "stage 1 receives recv_act1 but the next message on its stream is send_act0 (for chunk "
        "0): sends and receives out of order, which NCCL (tags ignored) would hand to the wrong "
        "receive"
    )


def test_chunks_sharing_a_stream_must_be_received_in_the_order_sent():
    """Interleaved 1F1B sends both chunks' activations from stage 0 to stage 1 on one channel
    group (one NCCL stream, tags ignored). Stage 0 sending micro 1's chunk-0 activation after
    micro 0's chunk-1 one keeps each chunk in order, which gloo's tags would sort out; NCCL hands
    the chunk-1 message to the chunk-0 receive, so simulate refuses it."""
    programs, roles = programs_for("interleaved-1f1b", 2, 2, 2)
    send = parse("send_act1")[0]
    programs[0].remove(send)
    programs[0].insert(programs[0].index(parse("send_act0.1")[0]) + 1, send)
    assert (
        "receives recv_act1 but the next message on its stream is send_act0.1 (for chunk "
        "1): sends and receives out of order" in deadlock(programs, roles)
    )


def test_a_message_never_received_is_caught():
    programs, roles = programs_for("1f1b", 2, 2)
    # stage 0 never takes micro 1's gradient (nor runs its backward)
    programs[0] = [x for x in programs[0] if x not in parse("recv_grad1 B1")]
    assert deadlock(programs, roles) == (
        "messages sent but never received: "
        "{(1, 0, 'grad'): [(Instr(op='send_grad', micro=1, chunk=0), 0)]}"
    )
    # an extra send nobody receives
    programs, roles = programs_for("1f1b", 2, 2)
    programs[1].insert(-2, Instr("send_grad", 5))
    with pytest.raises(RuntimeError, match="^messages sent but never received: .*micro=5"):
        simulate(programs, roles)


def test_deadlock_when_stage_0_backwards_first():
    programs, roles = programs_for("1f1b", 2, 2)
    programs[0] = program(parse("B0 B1 F0 F1"), roles[0])
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 1 blocked at recv_act0 on a message for recv_act0 (after 0 instructions)"
    )


def test_deadlock_when_last_stage_backwards_before_its_forward():
    programs, roles = programs_for("1f1b", 3, 4)
    programs[2] = program(parse("B0 F0 F1 B1 F2 B2 F3 B3"), roles[2])
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 1 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 2 blocked at B0 on its own F0 (after 12 instructions)"
    )


def test_deadlock_on_a_backward_before_its_forward_on_one_stage():
    programs, roles = programs_for("zb-h1", 1, 2)
    programs[0] = parse("I0 F0 W0 F1 I1 W1 reduce step")
    with pytest.raises(
        RuntimeError,
        match=r"^deadlock: stage 0 blocked at I0 on its own F0 "
        r"\(after 0 instructions\)$",
    ):
        simulate(programs, roles)
    programs[0] = parse("F0 W0 I0 F1 I1 W1 reduce step")
    with pytest.raises(RuntimeError, match=r"^deadlock: stage 0 blocked at W0 on its own I0 "):
        simulate(programs, roles)


def deadlock(programs: list[list[Instr]], roles: list[StageRole]) -> str:
    """The message `simulate` raises for `programs`."""
    with pytest.raises(RuntimeError) as e:
        simulate(programs, roles)
    return str(e.value)


def test_deadlock_between_stages_that_disagree_on_the_order():
    # stage 0 waits for B0's gradient before forwarding micro 1; stage 1 wants micro 1's
    # activation before it runs B0: each stage holds what the other needs
    roles = roles_for(2)
    programs = [program(parse("F0 B0 F1 B1"), roles[0]), program(parse("F0 F1 B0 B1"), roles[1])]
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 1 blocked at recv_act1 on a message for recv_act1 (after 4 instructions)"
    )


def test_deadlock_names_finished_stages_and_the_step_barrier():
    roles = roles_for(2)
    # stage 0 never forwards micro 1
    programs = [program(parse("F0 B0"), roles[0]), program(parse("F0 F1 B0 B1"), roles[1])]
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 1 blocked at recv_act1 on a message for recv_act1 (after 4 instructions)"
    )
    # stage 1 stops early: it waits at its step for a stage that never gets there
    programs = [program(parse("F0 F1 B0 B1"), roles[0]), program(parse("F0 B0"), roles[1])]
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad1 on a message for recv_grad1; "
        "stage 1 blocked at step on every stage at its step (the gradient norm spans the "
        "replica) (after 11 instructions)"
    )
    # stage 1 has nothing to run
    programs = [program(parse("F0 B0"), roles[0]), []]
    assert deadlock(programs, roles) == (
        "deadlock: stage 0 blocked at recv_grad0 on a message for recv_grad0; "
        "stage 1 finished (after 2 instructions)"
    )


def test_deadlock_on_a_tied_exchange_without_its_partner():
    programs, roles = programs_for("1f1b", 2, 2, ties=True)
    programs[1] = [x for x in programs[1] if x.op != "tied_borrow"]
    with pytest.raises(
        RuntimeError,
        match=r"^deadlock: stage 0 blocked at tied_lend on a stage "
        r"at tied_borrow; stage 1 blocked at recv_act0 ",
    ):
        simulate(programs, roles)
    programs, roles = programs_for("1f1b", 2, 2, ties=True)
    programs[0] = [x for x in programs[0] if x.op != "tied_add"]
    with pytest.raises(
        RuntimeError,
        match=r"^deadlock: stage 0 blocked at step on every stage "
        r".*; stage 1 blocked at tied_return on a stage at tied_add ",
    ):
        simulate(programs, roles)


def test_the_independent_check_rejects_broken_orders():
    programs, roles = programs_for("1f1b", 2, 2)
    order = simulate(programs, roles)
    check_simulated_order(programs, roles, order)
    # stage 1 receiving micro 0 before stage 0 sent it (stage 1's own order is unchanged)
    i = order.index((1, Instr("recv_act", 0)))
    early = [order[i]] + order[:i] + order[i + 1 :]
    with pytest.raises(AssertionError, match=r"^stage 1 ran recv_act0 with \[\] in flight"):
        check_simulated_order(programs, roles, early)


def test_a_backward_before_its_gradient_arrives_is_caught():
    roles = roles_for(2)
    programs = [
        parse("F0 send_act0 B0 recv_grad0 reduce step"),  # B0 runs without its gradient
        program(one_f_one_b(2, 1, 1), roles[1]),
    ]
    with pytest.raises(RuntimeError, match="stage 0 blocked at B0 on its own recv_grad0"):
        simulate(programs, roles)


# ---- time: timeline, bubble, chart ------------------------------------------------------------


def theory(name: str, p: int, m: int, v: int) -> float:
    return {
        "1f1b": (p - 1) / m,
        "gpipe": (p - 1) / m,
        "interleaved-1f1b": (p - 1) / (v * m),
        "zb-h1": (p - 1) / (3 * m),
    }[name]


def test_bubble_at_unit_costs_equals_theory():
    for name in SCHEDULES:
        for p in range(2, 7):
            for m in range(p, 4 * p + 1, p):
                for v in (2, 3) if name == "interleaved-1f1b" else (1,):
                    rows = timeline(*programs_for(name, p, m, v))
                    assert bubble(rows) == pytest.approx(theory(name, p, m, v), abs=1e-9), (
                        name,
                        p,
                        m,
                        v,
                    )


def test_bubble_is_the_same_with_ties_and_without_one_stage_none():
    assert bubble(timeline(*programs_for("1f1b", 4, 8, ties=True, sp_sum=True))) == (
        pytest.approx(3 / 8, abs=1e-9)
    )
    assert bubble(timeline(*programs_for("1f1b", 1, 5))) == 0.0


def test_zero_bubble_beats_one_f_one_b():
    for p in range(2, 7):
        for m in range(1, 13):
            zb = bubble(timeline(*programs_for("zb-h1", p, m)))
            ofob = bubble(timeline(*programs_for("1f1b", p, m)))
            assert zb < ofob, (p, m, zb, ofob)


def test_timeline_golden_and_costs():
    rows = timeline(*programs_for("1f1b", 2, 2))
    assert [[(start, end, str(x)) for start, end, x in row] for row in rows] == [
        [(0.0, 1.0, "F0"), (1.0, 2.0, "F1"), (4.0, 6.0, "B0"), (7.0, 9.0, "B1")],
        [(1.0, 2.0, "F0"), (2.0, 4.0, "B0"), (4.0, 5.0, "F1"), (5.0, 7.0, "B1")],
    ]
    # costs are per op; with chunks the default is a chunk's share of the stage
    rows = timeline(*programs_for("1f1b", 2, 2), cost={"F": 1.0, "B": 1.0})
    assert rows[0][-1][1] == 6.0
    rows = timeline(*programs_for("interleaved-1f1b", 2, 2, 2))
    assert {end - start for row in rows for start, end, x in row if x.op == "F"} == {0.5}


def test_chart_lines():
    for name, p, m, v in [
        ("1f1b", 4, 8, 1),
        ("gpipe", 3, 5, 1),
        ("zb-h1", 4, 6, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("1f1b", 6, 12, 1),
    ]:
        rows = timeline(*programs_for(name, p, m, v))
        for width in (96, 40, 13, 5):
            lines = chart(rows, width)
            where = (name, p, m, v, width, lines)
            assert len(lines) == p, where
            prefixes = [f"stage {s}: " for s in range(p)]
            assert all(line.startswith(pre) for line, pre in zip(lines, prefixes, strict=True))
            assert len({len(line) for line in lines}) == 1, where
            assert all(
                0 < len(line) - len(pre) <= width for line, pre in zip(lines, prefixes, strict=True)
            ), where
            assert all(
                set(line[len(pre) :]) <= set("FBIWfbiw.")
                for line, pre in zip(lines, prefixes, strict=True)
            ), where
            if name == "1f1b" and width >= 40:  # a character is at most 1 F: p - 1 idle ones
                assert lines[-1][len(prefixes[-1])] == ".", where  # the last stage starts idle


def test_chart_golden():
    rows = timeline(*programs_for("1f1b", 2, 2))
    assert chart(rows) == ["stage 0: FF..BB.BB", "stage 1: .FBBFBB.."]
    # odd chunks in lowercase
    rows = timeline(*programs_for("interleaved-1f1b", 2, 4, 2))
    assert chart(rows) == [
        "stage 0: FFffF.bbFbbfBBfBB.bb.bbBBBB",
        "stage 1: .FFfbbfbbFBBFBBfbbfbbBBBB..",
    ]
    rows = timeline(*programs_for("zb-h1", 3, 3))
    assert chart(rows) == ["stage 0: FFF..IWIWIW", "stage 1: .FF.IFIWIWW", "stage 2: ..FIFIFIWWW"]


# ---- parity with DeepSpeed's TrainSchedule ----------------------------------------------------


@pytest.fixture(scope="module")
def ds_schedule():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # no accelerator auto-detection warning
        return importlib.import_module("deepspeed.runtime.pipe.schedule")


def deepspeed_order(ds_schedule, pp: int, stage: int, m: int) -> tuple[list[Instr], int]:
    """DeepSpeed's forward/backward order for one stage, and its number of pipe buffers.

    DeepSpeed names buffers, not micro-batches: a ring of ``num_pipe_buffers()`` slots. Micro
    ids are handed out in order (the k-th ForwardPass is micro k, the k-th BackwardPass micro k);
    the assertion checks that this agrees with the ring, i.e. that the mapping is DeepSpeed's.
    """
    sched = ds_schedule.TrainSchedule(micro_batches=m, stages=pp, stage_id=stage)
    buffers = sched.num_pipe_buffers()
    instrs: list[Instr] = []
    count = {FORWARD: 0, BACKWARD: 0}
    for cmds in sched.steps():
        for cmd in cmds:
            if isinstance(cmd, ds_schedule.ForwardPass):
                op = FORWARD
            elif isinstance(cmd, ds_schedule.BackwardPass):
                op = BACKWARD
            else:
                continue
            micro = count[op]
            count[op] += 1
            assert cmd.buffer_id == micro % buffers, (op, micro, cmd.buffer_id, buffers)
            instrs.append(Instr(op, micro))
    return instrs, buffers


def test_one_f_one_b_equals_deepspeed_train_schedule(ds_schedule):
    for pp in ALL_PP:
        for m in ALL_M:
            for stage in range(pp):
                ours = one_f_one_b(pp, stage, m)
                theirs, buffers = deepspeed_order(ds_schedule, pp, stage, m)
                assert show(ours) == show(theirs), (pp, stage, m)
                # DeepSpeed sizes its stash ring by the same bound (floored at 2 for send/recv)
                assert buffers == max(2, max_in_flight(ours)), (pp, stage, m)
