"""Pipeline schedules as pure data: one list of `Action`s ("F3", "B0") per stage.

A schedule decides *when* each stage runs the forward and backward of each micro-batch; the
executor only dispatches the list it is given (receive what the action needs, compute, send).
Keeping schedules free of torch.distributed lets the properties that matter be tested without
processes: every micro-batch is forwarded once and then backwarded once, the number of stashed
activations stays bounded, and the stages' lists together never deadlock (`simulate`).

Dependencies between stages, as the executor sees them (sends are buffered, so a stage blocks
only on the receive of its next action):

- ``F(m)`` on stage ``s > 0`` needs micro ``m``'s activation, i.e. stage ``s - 1`` did ``F(m)``;
- ``B(m)`` on stage ``s < last`` needs micro ``m``'s output gradient, i.e. stage ``s + 1`` did
  ``B(m)``;
- ``B(m)`` on any stage needs that stage's own ``F(m)`` (the stashed activations it
  differentiates through; on the last stage, the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One unit of work on one stage: the forward or backward of one micro-batch.

    Frozen and hashable so schedules compare as plain lists and actions can key sets and dicts.
    """

    kind: str  # FORWARD ("F") or BACKWARD ("B")
    micro: int  # micro-batch index, 0 .. num_micro - 1

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")
        if self.micro < 0:
            raise ValueError(f"Action micro-batch index must be >= 0, got {self.micro}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def _check(num_stages: int, stage: int, num_micro: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if num_micro < 1:
        raise ValueError(f"num_micro must be >= 1, got {num_micro}")


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[Action]:
    """The 1F1B schedule (PipeDream-flush, Megatron's non-interleaved schedule) for one stage.

    Same bubble as GPipe, but a stage holds at most ``min(num_stages - stage, num_micro)``
    micro-batches' activations instead of all ``num_micro``: memory no longer grows with the
    number of micro-batches, so more of them can shrink the bubble.

    The per-stage order equals DeepSpeed's ``TrainSchedule`` (its ForwardPass/BackwardPass
    sequence, micro ids assigned in order), checked for 1..8 stages and 1..32 micro-batches by
    the unit tests. DeepSpeed spreads the same order over 2 * (num_micro + num_stages - 1)
    lock-step slots, half of them idle on each stage; here only the order is kept and the
    executor blocks on receives instead.
    """
    _check(num_stages, stage, num_micro)
    # Phases on stage s, with p = num_stages and m = num_micro:
    #   warm-up:   F0 .. F(w-1) with w = min(p - s - 1, m). B0 cannot arrive before micro 0 has
    #              gone forward through the p - s - 1 later stages and back, so the stage fills
    #              that wait with forwards.
    #   steady:    for i in 0 .. m - w - 1: F(w + i), B(i). Forward first: the backward's
    #              gradient is still on its way while the stage computes.
    #   cool-down: B(m - w) .. B(m - 1), the backwards of the warm-up forwards.
    # In flight (forwarded, not yet backwarded): w after warm-up, w + 1 after each steady F,
    # back to w after each steady B. So the peak is w + 1 = p - s when the steady phase runs
    # (m > p - s - 1) and m otherwise: exactly min(p - s, m). Stage 0 stashes the most, the
    # last stage just one (F0 B0 F1 B1 ...).
    warmup = min(num_stages - stage - 1, num_micro)
    actions = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        actions.append(Action(FORWARD, warmup + i))
        actions.append(Action(BACKWARD, i))
    actions.extend(Action(BACKWARD, i) for i in range(num_micro - warmup, num_micro))
    return actions


def gpipe(num_stages: int, stage: int, num_micro: int) -> list[Action]:
    """GPipe for one stage: all forwards, then all backwards (in micro-batch order).

    The simplest correct schedule and the reference to compare 1F1B against: same bubble, but
    every stage stashes all ``num_micro`` activations at the turn.
    """
    _check(num_stages, stage, num_micro)
    return [Action(FORWARD, i) for i in range(num_micro)] + [
        Action(BACKWARD, i) for i in range(num_micro)
    ]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
}


def schedule(name: str, num_stages: int, stage: int, num_micro: int) -> list[Action]:
    """The actions of `stage` under the schedule called `name` ("1f1b" or "gpipe")."""
    try:
        build = SCHEDULES[name]
    except KeyError:
        known = ", ".join(repr(n) for n in SCHEDULES)
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {known}") from None
    return build(num_stages, stage, num_micro)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any point of `actions`.

    This is the number of activation stashes a stage needs (DeepSpeed's ``num_pipe_buffers``),
    i.e. its activation memory in units of one micro-batch. Assumes a well-formed list (each
    backward after its forward).
    """
    in_flight = peak = 0
    for action in actions:
        in_flight += 1 if action.kind == FORWARD else -1
        peak = max(peak, in_flight)
    return peak


def _unmet(stage: int, action: Action, num_stages: int, done: list[set[Action]]) -> str | None:
    """What `action` on `stage` still waits for, or None when it can run now."""
    if action.kind == FORWARD:
        if stage > 0 and action not in done[stage - 1]:
            return f"stage {stage - 1}'s F{action.micro} activation"
        return None
    if Action(FORWARD, action.micro) not in done[stage]:
        return f"its own F{action.micro}"
    if stage < num_stages - 1 and action not in done[stage + 1]:
        return f"stage {stage + 1}'s B{action.micro} gradient"
    return None


def simulate(actions_per_stage: list[list[Action]]) -> list[tuple[int, Action]]:
    """Run every stage's list in lock-step ticks and return the global order of execution.

    Each tick, every stage whose next action's dependencies (see the module docstring) were met
    by the end of the previous tick runs that action; a result is visible to the neighbours from
    the next tick on, like a message in flight. Within a tick, stages are listed in increasing
    order. This is the executor with buffered sends and blocking receives, so a list set that
    completes here cannot hang on real ranks for want of a message.

    Raises:
        RuntimeError: ``"deadlock: ..."`` naming each unfinished stage's blocked action and what
            it waits for, when no stage can progress before all lists are done.
    """
    num_stages = len(actions_per_stage)
    done: list[set[Action]] = [set() for _ in range(num_stages)]
    position = [0] * num_stages
    order: list[tuple[int, Action]] = []

    def pending(stage: int) -> bool:
        return position[stage] < len(actions_per_stage[stage])

    while any(pending(s) for s in range(num_stages)):
        ready = [
            s
            for s in range(num_stages)
            if pending(s) and _unmet(s, actions_per_stage[s][position[s]], num_stages, done) is None
        ]
        if not ready:
            blocked = []
            for s in range(num_stages):
                if not pending(s):
                    blocked.append(f"stage {s} finished")
                    continue
                action = actions_per_stage[s][position[s]]
                waits = _unmet(s, action, num_stages, done)
                blocked.append(f"stage {s} blocked at {action} (action {position[s]}) on {waits}")
            raise RuntimeError(
                "deadlock: " + "; ".join(blocked) + f" (after {len(order)} actions ran)"
            )
        for s in ready:  # decided on the state at the start of the tick, applied together
            action = actions_per_stage[s][position[s]]
            order.append((s, action))
            position[s] += 1
        for s, action in order[len(order) - len(ready) :]:
            done[s].add(action)
    return order
