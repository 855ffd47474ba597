"""Pipeline schedules as pure data: per-stage properties, cross-stage simulation, DeepSpeed parity.

No processes: `simulate` stands in for the ranks. The dependency check on its output is written
here independently of `dsnd.pipeline.schedule`, so a bug in `simulate` cannot hide one in a
schedule.
"""

from __future__ import annotations

import importlib

import pytest

from dsnd.pipeline.schedule import (
    SCHEDULES,
    Action,
    gpipe,
    max_in_flight,
    one_f_one_b,
    schedule,
    simulate,
)

ALL_PP = range(1, 9)
ALL_M = range(1, 33)


def parse(text: str) -> list[Action]:
    """ "F0 F1 B0" -> [Action("F", 0), Action("F", 1), Action("B", 0)]."""
    return [Action(word[0], int(word[1:])) for word in text.split()]


def show(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


def all_stages(name: str, pp: int, m: int) -> list[list[Action]]:
    return [schedule(name, pp, s, m) for s in range(pp)]


# ---- Action and the schedule() front door --------------------------------------------------------


def test_action_prints_as_kind_and_micro():
    assert str(Action("F", 3)) == "F3"
    assert str(Action("B", 0)) == "B0"
    assert Action("F", 1) == Action("F", 1) and hash(Action("F", 1)) == hash(Action("F", 1))
    assert parse("F3 B0") == [Action("F", 3), Action("B", 0)]


@pytest.mark.parametrize("kind, micro", [("X", 0), ("f", 0), ("F", -1)])
def test_action_rejects_bad_fields(kind, micro):
    with pytest.raises(ValueError):
        Action(kind, micro)


def test_schedule_dispatches_by_name():
    assert schedule("1f1b", 4, 1, 6) == one_f_one_b(4, 1, 6)
    assert schedule("gpipe", 4, 1, 6) == gpipe(4, 1, 6)
    assert sorted(SCHEDULES) == ["1f1b", "gpipe"]


def test_unknown_schedule_name_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule '1F1B'.*'1f1b', 'gpipe'"):
        schedule("1F1B", 2, 0, 4)


@pytest.mark.parametrize("build", [one_f_one_b, gpipe])
@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 4), "num_stages must be >= 1, got 0"),
        ((4, 4, 4), r"stage must be in \[0, 4\), got 4"),
        ((4, -1, 4), r"stage must be in \[0, 4\), got -1"),
        ((4, 0, 0), "num_micro must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_value_errors(build, args, message):
    with pytest.raises(ValueError, match=message):
        build(*args)


# ---- golden lists --------------------------------------------------------------------------------


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


# ---- per-stage properties and cross-stage simulation, every (pp, m) ------------------------------


def check_simulated_order(lists: list[list[Action]], order: list[tuple[int, Action]]) -> None:
    """Every stage ran its own list in its order, and every action after what it needs."""
    pp = len(lists)
    assert [[a for s, a in order if s == stage] for stage in range(pp)] == lists
    seen: set[tuple[int, Action]] = set()
    for stage, action in order:
        if action.kind == "F":
            needs = [(stage - 1, action)] if stage > 0 else []
        else:
            needs = [(stage, Action("F", action.micro))]
            if stage < pp - 1:
                needs.append((stage + 1, action))
        for need in needs:
            assert need in seen, f"stage {stage} ran {action} before {need}"
        seen.add((stage, action))


@pytest.mark.parametrize("pp", ALL_PP)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_schedule_properties(name, pp):
    # every m in ALL_M inside one item: 512 cases without 512 items of pytest overhead
    for m in ALL_M:
        lists = all_stages(name, pp, m)
        for stage, actions in enumerate(lists):
            where = f"{name} pp={pp} m={m} stage={stage}: {show(actions)}"
            forwards = [a.micro for a in actions if a.kind == "F"]
            backwards = [a.micro for a in actions if a.kind == "B"]
            # each micro-batch forwarded exactly once and backwarded exactly once, both in order
            assert forwards == list(range(m)) and backwards == list(range(m)), where
            assert len(actions) == 2 * m, where
            # ... and its forward comes first on this stage
            at = {action: i for i, action in enumerate(actions)}
            assert all(at[Action("F", i)] < at[Action("B", i)] for i in range(m)), where
            expected = min(pp - stage, m) if name == "1f1b" else m
            assert max_in_flight(actions) == expected, where
        check_simulated_order(lists, simulate(lists))


def test_one_f_one_b_stashes_less_than_gpipe_once_micro_batches_outnumber_stages():
    assert [max_in_flight(one_f_one_b(4, s, 16)) for s in range(4)] == [4, 3, 2, 1]
    assert [max_in_flight(gpipe(4, s, 16)) for s in range(4)] == [16] * 4


def test_max_in_flight_counts_forwarded_not_yet_backwarded():
    assert max_in_flight([]) == 0
    assert max_in_flight(parse("F0 B0 F1 B1")) == 1
    assert max_in_flight(parse("F0 F1 B0 F2 B1 B2")) == 2


# ---- simulate ------------------------------------------------------------------------------------


def test_simulate_runs_stages_in_lock_step_ticks():
    # a result is visible to the neighbour from the next tick on
    order = simulate([parse("F0 F1 B0 B1"), parse("F0 B0 F1 B1")])
    assert [f"{s}:{a}" for s, a in order] == [
        "0:F0",  # tick 0: stage 1 waits for F0's activation
        "0:F1", "1:F0",
        "1:B0",  # stage 0 waits for B0's gradient
        "0:B0", "1:F1",
        "1:B1",
        "0:B1",
    ]  # fmt: skip


def test_simulate_of_nothing_is_nothing():
    assert simulate([]) == []
    assert simulate([[], []]) == []


def test_deadlock_when_stage_0_backwards_first():
    lists = all_stages("1f1b", 2, 2)
    lists[0] = parse("B0 B1 F0 F1")
    with pytest.raises(RuntimeError) as e:
        simulate(lists)
    assert str(e.value) == (
        "deadlock: stage 0 blocked at B0 (action 0) on its own F0; "
        "stage 1 blocked at F0 (action 0) on stage 0's F0 activation (after 0 actions ran)"
    )


def test_deadlock_when_last_stage_backwards_before_its_forward():
    lists = all_stages("1f1b", 3, 4)
    lists[2] = parse("B0 F0 F1 B1 F2 B2 F3 B3")
    with pytest.raises(RuntimeError, match=r"^deadlock: .*stage 2 blocked at B0 \(action 0\) on "
                       r"its own F0"):  # fmt: skip
        simulate(lists)


def test_deadlock_between_stages_that_disagree_on_the_order():
    # stage 0 waits for B0's gradient before forwarding micro 1; stage 1 wants micro 1's
    # activation before it runs B0: each stage holds what the other needs
    lists = [parse("F0 B0 F1 B1"), parse("F0 F1 B0 B1")]
    with pytest.raises(RuntimeError) as e:
        simulate(lists)
    assert str(e.value) == (
        "deadlock: stage 0 blocked at B0 (action 1) on stage 1's B0 gradient; "
        "stage 1 blocked at F1 (action 1) on stage 0's F1 activation (after 2 actions ran)"
    )


def test_deadlock_names_finished_stages_and_missing_micro_batches():
    lists = [parse("F0 B0"), parse("F0 F1 B0 B1")]  # stage 0 never forwards micro 1
    with pytest.raises(RuntimeError) as e:
        simulate(lists)
    message = str(e.value)
    assert message.startswith("deadlock: stage 0 blocked at B0 (action 1) on stage 1's B0")
    assert "stage 1 blocked at F1 (action 1) on stage 0's F1 activation" in message

    lists = [parse("F0 F1 B0 B1"), parse("F0 B0")]  # stage 1 stops early
    with pytest.raises(RuntimeError, match=r"stage 0 blocked at B1 .*; stage 1 finished"):
        simulate(lists)


# ---- parity with DeepSpeed's TrainSchedule -------------------------------------------------------


@pytest.fixture(scope="module")
def ds_schedule():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # no accelerator auto-detection warning
        return importlib.import_module("deepspeed.runtime.pipe.schedule")


def deepspeed_order(ds_schedule, pp: int, stage: int, m: int) -> tuple[list[Action], int]:
    """DeepSpeed's forward/backward order for one stage, and its number of pipe buffers.

    DeepSpeed names buffers, not micro-batches: a ring of ``num_pipe_buffers()`` slots. Micro
    ids are handed out in order (the k-th ForwardPass is micro k, the k-th BackwardPass micro k);
    the assertion checks that this agrees with the ring, i.e. that the mapping is DeepSpeed's.
    """
    sched = ds_schedule.TrainSchedule(micro_batches=m, stages=pp, stage_id=stage)
    buffers = sched.num_pipe_buffers()
    actions: list[Action] = []
    count = {"F": 0, "B": 0}
    for cmds in sched.steps():
        for cmd in cmds:
            if isinstance(cmd, ds_schedule.ForwardPass):
                kind = "F"
            elif isinstance(cmd, ds_schedule.BackwardPass):
                kind = "B"
            else:
                continue
            micro = count[kind]
            count[kind] += 1
            assert cmd.buffer_id == micro % buffers, (kind, micro, cmd.buffer_id, buffers)
            actions.append(Action(kind, micro))
    return actions, buffers


@pytest.mark.parametrize("pp", ALL_PP)
def test_one_f_one_b_equals_deepspeed_train_schedule(ds_schedule, pp):
    for m in ALL_M:
        for stage in range(pp):
            ours = one_f_one_b(pp, stage, m)
            theirs, buffers = deepspeed_order(ds_schedule, pp, stage, m)
            assert show(ours) == show(theirs), (pp, stage, m)
            # DeepSpeed sizes its stash ring by the same bound (floored at 2 for its send/recv)
            assert buffers == max(2, max_in_flight(ours)), (pp, stage, m)
