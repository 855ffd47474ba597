"""Every layout a world admits, each predicted (memory per device, step time), ranked, and the
best one explained against its nearest rivals.

A layout is (pp, tp, dp, cp, ZeRO stage, micro-batch, activation checkpointing, schedule, and
for a mixture of experts ep: the expert-parallel ranks, a divisor of dp and of the experts). The
global batch (sequences) is fixed; the micro-batches per step follow: global / (micro x dp).
Tensor parallelism stays inside a node, splits heads and key/value heads evenly and runs with
sequence parallelism (less memory, the same bytes); context parallelism is the ring (any heads);
the schedules are dsnd's: 1f1b, interleaved-1f1b (2 chunks, micro-batches a multiple of pp) and
zb-h1 (ZeRO 0-2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from dsnd.layout_search import memory as mem
from dsnd.layout_search.hardware import Device
from dsnd.layout_search.shape import ModelShape
from dsnd.layout_search.timing import Step, head_in_flight, in_flight, step_seconds
from dsnd.layout_search.zero_sizes import reduce_bucket, sized_hidden
from dsnd.plan.memory import held_gradient_bytes
from dsnd.plan.plan import ZERO_STAGES

HEADROOM = 0.9  # a layout fits when it needs at most this share of the device's memory
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)

Split = Callable[[int, int], list[list[int]]]  # (pp, chunks) -> each stage's layers


@dataclass
class Layout:
    pp: int
    tp: int
    dp: int
    cp: int
    zero_stage: int
    micro_batch: int
    activation_checkpointing: bool
    schedule: str
    virtual_stages: int = 1
    micro_batches: int = 0  # per step
    ep: int = 1
    params_count: int = 0
    memory_bytes: dict[str, float] = field(default_factory=dict)
    deepspeed_estimate_bytes: float | None = None
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    mfu_range: tuple[float, float] | None = None  # what published runs' spread makes of `mfu`
    fits: bool = False

    @property
    def total_bytes(self) -> float:
        return sum(self.memory_bytes.values())

    def key(self) -> str:
        ac = " ac" if self.activation_checkpointing else ""
        chunks = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"pp={self.pp} tp={self.tp} dp={self.dp}{ep} cp={self.cp} zero={self.zero_stage} "
            f"mb={self.micro_batch}{ac} {self.schedule}{chunks}"
        )

    def as_json(self) -> dict:
        out = asdict(self)
        out["memory_bytes"] = {k: int(v) for k, v in self.memory_bytes.items()}
        return out


@dataclass(frozen=True)
class Problem:
    shape: ModelShape
    split: Split
    world: int
    device: Device
    seq: int
    global_batch: int
    bf16: bool
    measured: dict[int, tuple[float, ...]] | None = None  # micro-batch -> Step.layer_seconds
    # DeepSpeed's estimator of model-state bytes, (zero stage, parameters, largest layer's,
    # devices per node, nodes) -> bytes, shown beside dsnd's own (the command passes
    # `dsnd.engine.deepspeed_api.estimate_model_states`: the search itself needs no DeepSpeed)
    estimate: Callable[[int, int, int, int, int], int] | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(pr: Problem) -> Iterator[Layout]:
    """Every (pp, tp, cp, dp, ZeRO, micro-batch, checkpointing, schedule) dsnd can run."""
    sh = pr.shape
    for pp in _divisors(pr.world):
        if pp > sh.num_layers:
            continue
        for tp in _divisors(pr.world // pp):
            if tp > pr.device.per_node or sh.heads % tp or sh.kv_heads % tp or pr.seq % tp:
                continue
            if sh.moe and tp > 1:  # MoE MLPs are replicated over tp: not modelled here yet
                continue
            for cp in _divisors(pr.world // (pp * tp)):
                if pr.seq % (2 * cp) and cp > 1:
                    continue
                dp = pr.world // (pp * tp * cp)
                for mb in MICRO_BATCHES:
                    if pr.global_batch % (mb * dp):
                        continue
                    m = pr.global_batch // (mb * dp)
                    for schedule, v in _schedules(pp, m, sh.num_layers):
                        for zero in ZERO_STAGES[schedule]:
                            for ac in (False, True):
                                for ep in _expert_parallel(sh, dp):
                                    yield Layout(
                                        pp, tp, dp, cp, zero, mb, ac, schedule, v, m, ep=ep
                                    )


def _expert_parallel(sh: ModelShape, dp: int) -> list[int]:
    """The ep a layout may take: divisors of dp that divide the experts (1 for a dense model)."""
    return [ep for ep in _divisors(dp) if sh.experts % ep == 0] if sh.moe else [1]


def _schedules(pp: int, m: int, blocks: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zb-h1", 1)]
    if m % pp == 0 and blocks >= 2 * pp:
        out.append(("interleaved-1f1b", 2))
    return out


def evaluate(pr: Problem, lay: Layout, stages: list[list[int]]) -> Layout:
    """Fill in the layout's predicted memory (its busiest stage's device) and step time."""
    sh, dev = pr.shape, pr.device
    lay.memory_bytes = _busiest_stage(pr, lay, stages)
    lay.params_count = sh.params
    lay.deepspeed_estimate_bytes = _deepspeed_estimate(pr, lay, stages)
    recompute = "full" if lay.activation_checkpointing else "none"
    st = Step(
        lay.pp,
        lay.tp,
        lay.dp,
        lay.cp,
        lay.zero_stage,
        lay.micro_batch,
        lay.micro_batches,
        pr.seq,
        lay.schedule,
        lay.virtual_stages,
        recompute,
        lay.tp > 1,
        pr.bf16,
        layer_seconds=_measured(pr, lay),
        ep=lay.ep,
    )
    lay.step_time_s = step_seconds(sh, stages, st, dev)
    tokens_step = pr.global_batch * pr.seq
    lay.tokens_per_s = tokens_step / lay.step_time_s
    flops = sum(sh.forward_flops(i, 1, pr.seq) for i in range(len(sh.layer_params))) * 3
    lay.mfu = lay.tokens_per_s * flops / (pr.world * dev.flops(pr.bf16))
    if dev.accuracy is not None:
        lay.mfu_range = (lay.mfu * dev.accuracy.low, lay.mfu * dev.accuracy.high)
    lay.fits = lay.total_bytes <= HEADROOM * dev.memory_bytes
    return lay


def _busiest_stage(pr: Problem, lay: Layout, stages: list[list[int]]) -> dict[str, float]:
    """The memory parts of the stage whose device holds the most (model states, activations of
    the micro-batches in flight, buffers)."""
    sh = pr.shape
    low = 2 if pr.bf16 else 4
    recompute = "full" if lay.activation_checkpointing else "none"
    sp = lay.tp > 1
    nd = lay.dp * lay.cp
    tokens = lay.micro_batch * pr.seq / lay.cp
    block = mem.block_activation_bytes(
        sh, lay.micro_batch, pr.seq, lay.tp, lay.cp, sp, recompute, low
    )
    whole = mem.block_activation_bytes(sh, lay.micro_batch, pr.seq, lay.tp, lay.cp, sp, "none", low)
    bucket = reduce_bucket(sized_hidden(pr.device.name, sh.hidden))  # as `dsnd plan --out` writes
    worst: dict[str, float] = {}
    for s, layers in enumerate(stages):
        experts = sh.experts_of(layers)  # routed experts: whole on every tensor-parallel rank
        psi = (sum(sh.layer_params[i] for i in layers) - experts) / lay.tp + experts
        parts = mem.states(lay.zero_stage, psi, nd, pr.bf16, experts, lay.ep)
        blocks = sum(1 for i in layers if i in sh.blocks)
        held = in_flight(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages)[s]
        per_chunk = blocks * block / lay.virtual_stages
        parts["activations"] = held * per_chunk + (whole if lay.activation_checkpointing else 0)
        if s == lay.pp - 1:  # the head's, for the micro-batches in flight on the last chunk
            parts["activations"] += mem.head_activation_bytes(
                sh, tokens, lay.tp, low
            ) * head_in_flight(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages)
        # a rank's share of its largest layer (its experts / ep)
        largest = max(
            (sh.layer_params[i] - sh.experts_of([i])) / lay.tp + sh.experts_of([i]) / lay.ep
            for i in layers
        )
        mine = psi - experts * (1 - 1 / lay.ep)  # what this rank holds of the stage
        parts["buffers"] = mem.buffers(lay.zero_stage, largest, min(bucket, mine), pr.bf16)
        parts["buffers"] += held_gradient_bytes(
            lay.zero_stage, int(psi), nd, pr.bf16, int(experts), lay.ep
        )
        if sum(parts.values()) > sum(worst.values()):
            worst = parts
    return worst


def _deepspeed_estimate(pr: Problem, lay: Layout, stages: list[list[int]]) -> float | None:
    """DeepSpeed's own estimate of the busiest stage's model states (`pr.estimate`), for
    ZeRO 2-3 without experts (DeepSpeed's estimator knows none)."""
    if pr.estimate is None or lay.zero_stage not in (2, 3) or lay.ep > 1:
        return None
    sh = pr.shape
    psi = max(sum(sh.layer_params[i] for i in layers) for layers in stages) / lay.tp
    per_node, nodes = mem.nodes(lay.dp * lay.cp, pr.device.per_node)
    return float(
        pr.estimate(lay.zero_stage, int(psi), int(sh.largest_layer / lay.tp), per_node, nodes)
    )


def _measured(pr: Problem, lay: Layout) -> tuple[float, ...] | None:
    """Measured layer times where they describe the layout's layers (whole, unsplit)."""
    if pr.measured is None or lay.tp > 1 or lay.cp > 1:
        return None
    return pr.measured.get(lay.micro_batch)


def plan(pr: Problem) -> list[Layout]:
    """Every candidate evaluated, fitting ones first, fastest first."""
    splits: dict[tuple[int, int], list[list[int]]] = {}
    out = []
    for lay in candidates(pr):
        key = (lay.pp, lay.virtual_stages)
        if key not in splits:
            splits[key] = pr.split(lay.pp, lay.virtual_stages)
        out.append(evaluate(pr, lay, splits[key]))
    out.sort(key=lambda x: (not x.fits, x.step_time_s, x.total_bytes))
    return out


KNOBS = (
    "pp",
    "tp",
    "cp",
    "ep",
    "zero_stage",
    "micro_batch",
    "activation_checkpointing",
    "schedule",
)
TIE = 0.005
"""Layouts within this relative difference of time (or memory) tie: their ratio prints 1.00x."""
CLOSE = 0.05
"""Layouts within this relative difference of time are too close for the model to rank: its
published runs spread further (`dsnd.layout_search.hardware.ACCURACY`)."""


def explain(layouts: list[Layout], gib: float = 1024**3) -> list[str]:
    """Why the best layout: for each knob, the best layout that sets it otherwise and what it
    costs (slower by a factor, or memory it does not have); a tie is said to be one."""
    best = layouts[0]
    span = (
        ""
        if best.mfu_range is None
        else (" ({:.1%}-{:.1%} going by published runs)".format(*best.mfu_range).replace("%-", "-"))
    )
    lines = [
        f"best: {best.key()}: {best.step_time_s:.3g} s/step, "
        f"{best.total_bytes / gib:.1f} GiB per device, MFU {best.mfu:.1%}{span}"
    ]
    for knob in KNOBS:
        rival = next((x for x in layouts if getattr(x, knob) != getattr(best, knob)), None)
        if rival is not None:
            lines.append(_why(knob, best, rival, gib))
    return lines


def _why(knob: str, best: Layout, rival: Layout, gib: float) -> str:
    name = {
        "zero_stage": "zero",
        "activation_checkpointing": "checkpointing",
        "micro_batch": "micro-batch",
    }.get(knob, knob)
    mine, other = f"{name}={getattr(best, knob)}", f"{name}={getattr(rival, knob)}"
    if not rival.fits:
        return (
            f"{mine} because every layout with another {name} needs more memory than fits: "
            f"the best, {rival.key()}, {rival.total_bytes / gib:.1f} GiB"
        )
    time = rival.step_time_s / best.step_time_s
    memory = rival.total_bytes / best.total_bytes
    them = f"the best with {other} ({rival.key()})"
    if time - 1 < TIE and abs(memory - 1) < TIE:
        return f"{mine} ties with {other}: {them} takes the same time and memory"
    if time - 1 < TIE and memory < 1:
        return f"{mine} ties with {other} on time: {them} needs {memory:.2f}x the memory"
    if time - 1 < TIE:
        return f"{mine} because at the same time {them} needs {memory:.2f}x the memory"
    if time - 1 < CLOSE:
        return (
            f"{mine}, narrowly: {them} takes {time:.2f}x the time, too close for the model to rank"
        )
    return f"{mine} because {them} takes {time:.2f}x the time"
