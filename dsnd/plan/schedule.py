"""Pipeline schedules as pure data: every instruction each stage runs in one optimizer step.

A schedule is built in two passes:

1. the *compute order* of a stage: forwards (F), backwards (B) — or, for zero-bubble schedules,
   input-gradient backwards (I) and weight-gradient backwards (W) — each with its micro-batch and
   its model chunk (a rank holds `v` chunks under interleaved 1F1B, one otherwise);
2. `program()` wraps that order into the stage's whole step: the receive before and the send
   after each compute instruction, the tied-weight exchange, the sequence-parallel gradient sum,
   the gradient reduction and the optimizer step.

The executor (`dsnd.pipeline.executor`) is a dispatch table over these instructions; nothing it
does in a step is left implicit. `simulate()` runs all stages' programs against each other
without processes and checks that every send meets its receive, in order, and that nothing
deadlocks; `timeline()` gives each instruction a start time under unit costs, from which the
bubble (`bubble()`) and the dry run's chart come.

Virtual stages: with `p` ranks and `v` chunks, chunk `c` of rank `s` is virtual stage
``c * p + s`` (Megatron's interleaving); activations flow vs → vs + 1, so from rank ``p - 1``
chunk ``c`` to rank 0 chunk ``c + 1``. With v = 1 the virtual stage is the rank's stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# compute
FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
# pipeline point-to-point
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "recv_act", "send_act", "recv_grad", "send_grad"
# a weight tied across stages (pipeline/tied.py): the owner lends it, the borrower returns its grad
TIED_LEND, TIED_BORROW = "tied_lend", "tied_borrow"
TIED_RETURN, TIED_ADD = "tied_return", "tied_add"
# the step's end: sequence-parallel partial-gradient sum, data-parallel reduction, optimizer step
SP_SUM, REDUCE, STEP = "sp_sum", "reduce", "step"

COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
OPS = COMPUTE + (
    RECV_ACT,
    SEND_ACT,
    RECV_GRAD,
    SEND_GRAD,
    TIED_LEND,
    TIED_BORROW,
    TIED_RETURN,
    TIED_ADD,
    SP_SUM,
    REDUCE,
    STEP,
)
GRADS = (BACKWARD, BACKWARD_WEIGHT)  # the instructions that leave weight gradients
SENDS, RECVS = (SEND_ACT, SEND_GRAD), (RECV_ACT, RECV_GRAD)


@dataclass(frozen=True)
class Instr:
    """One instruction of a stage's step. `micro` and `chunk` are -1 / 0 where they do not apply
    (tied exchange, reduction, step). Frozen and hashable: programs compare as plain lists."""

    op: str
    micro: int = -1
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown instruction {self.op!r}; expected one of {', '.join(OPS)}")
        if self.chunk < 0 or (self.micro < 0 and self.op in COMPUTE + SENDS + RECVS):
            raise ValueError(f"bad micro-batch/chunk for {self.op}: {self.micro}, {self.chunk}")

    def __str__(self) -> str:
        if self.micro < 0:
            return self.op
        return f"{self.op}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def _check(p: int, s: int, m: int, v: int) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, micro-batches and chunks must be >= 1, got {p}, {m}, {v}")
    if not 0 <= s < p:
        raise ValueError(f"stage must be in [0, {p}), got {s}")


def _one_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ValueError(f"the {name} schedule runs one model chunk per stage, got {v}")


# ---- compute orders ---------------------------------------------------------------------------


def gpipe(p: int, s: int, m: int, v: int = 1) -> list[Instr]:
    """All forwards, then all backwards: the reference schedule; every stage stashes m
    activations at the turn."""
    _check(p, s, m, v)
    _one_chunk("gpipe", v)
    return [Instr(FORWARD, i) for i in range(m)] + [Instr(BACKWARD, i) for i in range(m)]


def one_f_one_b(p: int, s: int, m: int, v: int = 1) -> list[Instr]:
    """1F1B (PipeDream-flush; DeepSpeed's TrainSchedule order, Megatron's non-interleaved).

    Warm-up: w = min(p - s - 1, m) forwards (the first backward cannot arrive sooner); steady:
    F(w + i), B(i); cool-down: the warm-up's backwards. At most min(p - s, m) activations are in
    flight, so memory does not grow with m while more micro-batches shrink the bubble
    (p - 1) / m.
    """
    _check(p, s, m, v)
    _one_chunk("1f1b", v)
    warmup = min(p - s - 1, m)
    order = [Instr(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Instr(FORWARD, warmup + i), Instr(BACKWARD, i)]
    return order + [Instr(BACKWARD, i) for i in range(m - warmup, m)]


def interleaved_1f1b(p: int, s: int, m: int, v: int = 2) -> list[Instr]:
    """Megatron's interleaved 1F1B: each rank runs v chunks, so the bubble is (p - 1) / (v m).

    Forwards go in rounds of p micro-batches through chunk 0, then the same p through chunk 1,
    ...; backwards walk the chunks in reverse. The k-th forward of a stage is micro
    ``(k // (p v)) p + k % p`` of chunk ``(k // p) % v``. Warm-up: ``2 (p - s - 1) + (v - 1) p``
    forwards, then one forward and one backward alternate. Needs m to be a multiple of p (the
    rounds), as Megatron does.
    """
    _check(p, s, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by stages ({p})")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    warmup = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
    order = [Instr(FORWARD, *unit(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order += [Instr(FORWARD, *unit(warmup + i, True)), Instr(BACKWARD, *unit(i, False))]
    return order + [Instr(BACKWARD, *unit(k, False)) for k in range(total - warmup, total)]


def zb_h1(p: int, s: int, m: int, v: int = 1) -> list[Instr]:
    """Zero-bubble ZB-H1: 1F1B with each backward split into its input gradient I (on the
    critical path: the previous stage waits for it) and its weight gradient W (nobody waits).

    The order of F and I is 1F1B's; stage s keeps up to s weight gradients pending, so the
    first stages run W in step while the last ones defer theirs into the cool-down bubble. A
    pending W holds its micro-batch's activations, so stage s holds at most
    min(p - s, m) + min(s, ...) <= p micro-batches, 1F1B's peak (stage 0). With F = I = W in
    time the bubble is (p - 1) / (3 m) of the compute, a third of 1F1B's.
    """
    _check(p, s, m, v)
    _one_chunk("zb-h1", v)
    order = []
    done_w = 0
    for instr in one_f_one_b(p, s, m):
        if instr.op == FORWARD:
            order.append(instr)
            continue
        order.append(Instr(BACKWARD_INPUT, instr.micro))
        if instr.micro + 1 - done_w > s:  # more than s weight gradients pending: run one
            order.append(Instr(BACKWARD_WEIGHT, done_w))
            done_w += 1
    return order + [Instr(BACKWARD_WEIGHT, i) for i in range(done_w, m)]


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Instr]]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}
MULTI_CHUNK = ("interleaved-1f1b",)  # schedules that take parallel.virtual_stages > 1
SPLIT_BACKWARD = ("zb-h1",)  # schedules that split B into I and W


def compute_order(name: str, p: int, s: int, m: int, v: int = 1) -> list[Instr]:
    """The compute instructions of stage `s` under the schedule called `name`."""
    try:
        build = SCHEDULES[name]
    except KeyError:
        known = ", ".join(repr(n) for n in SCHEDULES)
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {known}") from None
    return build(p, s, m, v)


# ---- whole programs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StageRole:
    """What a stage's program needs besides its compute order."""

    stage: int
    stages: int  # p
    chunks: int = 1  # v
    tie: str | None = None  # "owner" or "borrower" of a weight tied across stages, or None
    sp_sum: bool = False  # sum sequence-parallel partial gradients over the tensor group


def program(compute: list[Instr], role: StageRole) -> list[Instr]:
    """The stage's whole step around its compute order (see the module docstring).

    The borrower of a tied weight gets it before its first forward and returns its gradient
    after its last weight-gradient instruction; the owner adds that gradient after its own, and
    before the reduction, so the data-parallel reduction and the step see the weight once.
    """
    last_vs = role.stages * role.chunks - 1
    out = {"owner": [Instr(TIED_LEND)], "borrower": [Instr(TIED_BORROW)], None: []}[role.tie]
    last_grad = max((i for i, x in enumerate(compute) if x.op in GRADS), default=-1)
    for index, x in enumerate(compute):
        vs = x.chunk * role.stages + role.stage
        if x.op == FORWARD:
            out += [Instr(RECV_ACT, x.micro, x.chunk)] if vs > 0 else []
            out.append(x)
            out += [Instr(SEND_ACT, x.micro, x.chunk)] if vs < last_vs else []
        elif x.op in (BACKWARD, BACKWARD_INPUT):
            out += [Instr(RECV_GRAD, x.micro, x.chunk)] if vs < last_vs else []
            out.append(x)
            out += [Instr(SEND_GRAD, x.micro, x.chunk)] if vs > 0 else []
        else:
            out.append(x)
        if index == last_grad:
            out += {"owner": [Instr(TIED_ADD)], "borrower": [Instr(TIED_RETURN)], None: []}[
                role.tie
            ]
    return out + ([Instr(SP_SUM)] if role.sp_sum else []) + [Instr(REDUCE), Instr(STEP)]


def max_in_flight(compute: list[Instr], chunk: int | None = None) -> int:
    """The most micro-batch chunks forwarded but not yet finished (B, or W when split) at any
    point: the activation stashes a stage needs (DeepSpeed's ``num_pipe_buffers``); of model
    chunk `chunk` only, when given."""
    split = any(x.op == BACKWARD_WEIGHT for x in compute)
    done = BACKWARD_WEIGHT if split else BACKWARD
    in_flight = peak = 0
    for x in compute:
        if chunk is not None and x.chunk != chunk:
            continue
        in_flight += (x.op == FORWARD) - (x.op == done)
        peak = max(peak, in_flight)
    return peak


# ---- running all stages' programs against each other ------------------------------------------


def channel(role: StageRole, x: Instr) -> tuple[int, int, str, int]:
    """(from rank, to rank, kind, receiving chunk) of the message `x` sends or receives."""
    p, s = role.stages, role.stage
    vs = x.chunk * p + s
    if x.op == SEND_ACT:  # to vs + 1
        return s, (vs + 1) % p, "act", (vs + 1) // p
    if x.op == RECV_ACT:  # from vs - 1
        return (vs - 1) % p, s, "act", x.chunk
    if x.op == SEND_GRAD:  # to vs - 1
        return s, (vs - 1) % p, "grad", (vs - 1) // p
    return (vs + 1) % p, s, "grad", x.chunk  # RECV_GRAD, from vs + 1


def stream(role: StageRole, x: Instr) -> tuple[int, int, str]:
    """(from rank, to rank, kind): the one-way channel whose process group carries the message
    `x` sends or receives, every chunk's (`dsnd.distributed.groups.channel_groups`). On NCCL a
    group's messages between two ranks run in issue order and tags are ignored, so on each
    stream the receiver must take the messages in the order they were sent."""
    return channel(role, x)[:3]


RENDEZVOUS = {TIED_LEND: TIED_BORROW, TIED_RETURN: TIED_ADD}  # blocking send -> its receive


class _Run:
    """The state of a lock-step run of every stage's program (see `simulate`)."""

    def __init__(self, programs: list[list[Instr]], roles: list[StageRole]) -> None:
        self.programs, self.roles = programs, roles
        self.pos = [0] * len(programs)
        # stream -> (message, receiving chunk) sent, not yet received
        self.queues: dict[tuple, list[tuple[Instr, int]]] = {}
        self.done: list[set[Instr]] = [set() for _ in programs]

    def next(self, s: int) -> Instr | None:
        return self.programs[s][self.pos[s]] if self.pos[s] < len(self.programs[s]) else None

    def waits_for(self, s: int) -> str | None:
        """What stage `s`'s next instruction waits for, or None when it can run now."""
        x = self.next(s)
        if x.op in RECVS:
            queue = self.queues.get(stream(self.roles[s], x), [])
            if not queue:
                return f"a message for {x}"
            sent, to_chunk = queue[0]
            if (sent.micro, to_chunk) != (x.micro, x.chunk):
                raise RuntimeError(
                    f"stage {s} receives {x} but the next message on its stream is {sent} "
                    f"(for chunk {to_chunk}): sends and receives out of order, which NCCL "
                    "(tags ignored) would hand to the wrong receive"
                )
        role = self.roles[s]
        vs, last_vs = x.chunk * role.stages + s, role.stages * role.chunks - 1
        needs = []  # what this instruction's inputs come from, on this stage
        if x.op == FORWARD and vs > 0:
            needs = [RECV_ACT]
        elif x.op in (BACKWARD, BACKWARD_INPUT):
            needs = [FORWARD] + ([RECV_GRAD] if vs < last_vs else [])
        elif x.op == BACKWARD_WEIGHT:
            needs = [BACKWARD_INPUT]
        for op in needs:
            if Instr(op, x.micro, x.chunk) not in self.done[s]:
                return f"its own {Instr(op, x.micro, x.chunk)}"
        if x.op in RENDEZVOUS or x.op in RENDEZVOUS.values() or x.op == STEP:
            peers = [t for t in range(len(self.programs)) if t != s]
            want = {STEP: STEP}.get(x.op) or RENDEZVOUS.get(x.op) or _sender(x.op)
            partner = [
                t
                for t in peers
                if self.next(t) is not None
                and self.next(t).op == want
                and (x.op == STEP or self.roles[t].tie != role.tie)
            ]
            if x.op == STEP and len(partner) != len(peers):
                return "every stage at its step (the gradient norm spans the replica)"
            if x.op != STEP and not partner:
                return f"a stage at {want}"
        return None

    def run(self, s: int) -> None:
        x = self.next(s)
        if x.op in SENDS:
            key = channel(self.roles[s], x)
            self.queues.setdefault(key[:3], []).append((x, key[3]))
        elif x.op in RECVS:
            self.queues[stream(self.roles[s], x)].pop(0)
        self.done[s].add(x)
        self.pos[s] += 1


def _sender(op: str) -> str:
    return next(send for send, recv in RENDEZVOUS.items() if recv == op)


def simulate(programs: list[list[Instr]], roles: list[StageRole]) -> list[tuple[int, Instr]]:
    """Run every stage's program in lock-step ticks; return the global order of execution.

    Each tick every stage whose next instruction can run does so: a receive needs its message
    (sent in an earlier tick, first on its `stream`: a message out of order raises), a compute
    instruction its inputs, a tied exchange (a blocking send) its partner at the matching
    instruction, the step every stage at its step (ZeRO's gradient norm is a collective over
    the replica). Raises RuntimeError("deadlock: ...") naming what each stage waits for, and
    when a message is never received.
    """
    run = _Run(programs, roles)
    order: list[tuple[int, Instr]] = []
    while any(run.next(s) is not None for s in range(len(programs))):
        ready = [
            s for s in range(len(programs)) if run.next(s) is not None and run.waits_for(s) is None
        ]
        if not ready:
            blocked = "; ".join(
                f"stage {s} finished"
                if run.next(s) is None
                else f"stage {s} blocked at {run.next(s)} on {run.waits_for(s)}"
                for s in range(len(programs))
            )
            raise RuntimeError(f"deadlock: {blocked} (after {len(order)} instructions)")
        for s in ready:  # decided on the state at the start of the tick, applied together
            order.append((s, run.next(s)))
        for s, _ in order[len(order) - len(ready) :]:
            run.run(s)
    left = {ch: q for ch, q in run.queues.items() if q}
    if left:
        raise RuntimeError(f"messages sent but never received: {left}")
    return order


# ---- time --------------------------------------------------------------------------------------

UNIT_COST = {FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}
"""A backward costs two forwards (input and weight gradients, one each)."""


def timeline(
    programs: list[list[Instr]], roles: list[StageRole], cost: dict[str, float] | None = None
) -> list[list[tuple[float, float, Instr]]]:
    """(start, end, instruction) of every compute instruction per stage, each as early as its
    dependencies allow, with compute costing `cost` per chunk (default `UNIT_COST` divided by
    the chunks: a chunk is 1/v of the stage) and communication free."""
    cost = cost or {op: c / roles[0].chunks for op, c in UNIT_COST.items()}
    clock = [0.0] * len(programs)
    sent: dict[tuple, list[float]] = {}
    rows: list[list[tuple[float, float, Instr]]] = [[] for _ in programs]
    for s, x in simulate(programs, roles):
        if x.op in SENDS:
            sent.setdefault(channel(roles[s], x), []).append(clock[s])
        elif x.op in RECVS:
            clock[s] = max(clock[s], sent[channel(roles[s], x)].pop(0))
        elif x.op in COMPUTE:
            start = clock[s]
            clock[s] += cost[x.op]
            rows[s].append((start, clock[s], x))
    return rows


def bubble(rows: list[list[tuple[float, float, Instr]]]) -> float:
    """Idle time over busy time of the busiest stage, in a timeline: (makespan - busy) / busy.
    1F1B's theory is (p - 1) / m; interleaved (p - 1) / (v m); ZB-H1 (p - 1) / (3 m)."""
    makespan = max(row[-1][1] for row in rows if row)
    busy = max(sum(end - start for start, end, _ in row) for row in rows)
    return (makespan - busy) / busy


def chart(rows: list[list[tuple[float, float, Instr]]], width: int = 96) -> list[str]:
    """One text row per stage: each compute instruction drawn as its letter over its duration
    (F forward, B backward, I input gradient, W weight gradient; lowercase on odd chunks, so
    interleaved chunks alternate), '.' where the stage idles. One character is the shortest
    instruction, or a multiple of it when the step would not fit in `width`."""
    makespan = max(row[-1][1] for row in rows if row)
    unit = min(end - start for row in rows for start, end, _ in row)
    per_char = unit * math.ceil(makespan / unit / width - 1e-9)
    lines = []
    for s, row in enumerate(rows):
        cells = ["."] * math.ceil(makespan / per_char - 1e-9)
        for start, end, x in row:
            letter = x.op if x.chunk % 2 == 0 else x.op.lower()
            for t in range(len(cells)):
                if start <= (t + 0.5) * per_char < end:
                    cells[t] = letter
        lines.append(f"stage {s}: " + "".join(cells))
    return lines
