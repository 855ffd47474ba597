"""One training step's time for a layout, from a device's datasheet and the efficiencies fitted to
published runs (`dsnd.layout_search.hardware.FITTED`).

Per micro-batch and pipeline layer, serially:
- matrix FLOPs (`ModelShape.forward_flops`, split over tensor and context ranks): forward once,
  backward twice, a full recomputation once more, a selective one the attention core again; the
  weight GEMMs and the attention core (QK^T, AV) at efficiencies of their own;
- element-wise memory traffic (norms, activations, residual adds, dropout, attention scores where
  a kernel writes them): the forward's bytes, twice that backward, again when recomputed;
- tensor-parallel collectives per block: forward two all-reduces (or, sequence-parallel, two
  all-gathers and two reduce-scatters, the same bytes), backward the same, recomputation again;
  ring volumes, on the node's links when the group fits in a node (tensor parallelism always
  does);
- context-parallel ring: each rank's K and V go around the ring forward, K, V and their
  gradients backward;
- pipeline messages: a micro-batch's activation forward and its gradient backward per stage;
- expert parallelism (ep > 1), per MoE block: the dispatch and combine all-to-alls, each a
  rank's T·k (token, choice) rows of the hidden width, of which (ep - 1)/ep leave the rank,
  forward, again backward (their gradients) and in a recomputation.

The pipeline then runs the busiest stage's micro-batches on the schedule's own timeline
(`dsnd.plan.schedule`, the bubble of that exact schedule); once per step the data-parallel
gradient reduction (ZeRO-3: plus a parameter all-gather in every micro-batch's forward and
backward) and the optimizer's pass over its states follow; a stage's routed experts are
reduced, gathered and stepped as a rank holds them: experts / ep over dp / ep ranks. The
data-parallel collectives run as NCCL's rings: across nodes at the node's network bandwidth
shared by the group's members on it (`_collective_link`); a fitted share of them (`overlap`)
hides under the pipelined compute, as DeepSpeed's overlapped reduction and ZeRO-3 prefetch and
FSDP do. Every kind of work runs at its own efficiency of its peak (`StepCost.seconds`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dsnd.layout_search.hardware import Device, Efficiency
from dsnd.layout_search.shape import ModelShape
from dsnd.plan.schedule import (
    StageRole,
    bubble,
    compute_order,
    max_in_flight,
    program,
    timeline,
)

OPTIMIZER_BYTES = 32  # per parameter an Adam step reads and writes (master, moments, grad, param)


@dataclass(frozen=True)
class Step:
    """What one step runs (the layout and the work, not the device)."""

    pp: int
    tp: int
    dp: int
    cp: int
    zero: int
    micro_batch: int
    micro_batches: int  # per step (gradient accumulation)
    seq: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"  # none | selective | full
    sp: bool = False
    bf16: bool = True
    scores_in_memory: bool = False  # attention writes its scores (no fused kernel)
    scatter_gather: bool = False  # pipeline messages split over the tensor ranks (Megatron's)
    ep: int = 1  # expert-parallel ranks (consecutive data-parallel ranks)
    layer_seconds: tuple[float, ...] | None = None
    """Measured forward + backward seconds of one micro-batch through each pipeline layer on this
    device (`dsnd.plan.profile.measure_layers`): they replace the FLOP and memory-traffic terms
    (a full recomputation adds a forward, a third of them)."""


def _short(p: int, m: int) -> int:
    """The micro-batches a schedule's timeline is simulated at: past 2p, 1F1B's, ZB-H1's and
    interleaved 1F1B's warm-up and cool-down (their idle time) and their in-flight counts no
    longer change with m (a unit test checks it), so 2p stands for any larger m."""
    return min(m, 2 * p)


@functools.lru_cache(maxsize=1024)
def schedule_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Idle ÷ busy of the busiest stage on the schedule's timeline (unit costs, free messages)."""
    if p == 1:
        return 0.0
    short = _short(p, m)
    roles = [StageRole(s, p, v) for s in range(p)]
    programs = [program(compute_order(schedule, p, s, short, v), roles[s]) for s in range(p)]
    return bubble(timeline(programs, roles)) * short / m


@functools.lru_cache(maxsize=1024)
def in_flight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Per stage, the most micro-batch chunks it holds activations for at once."""
    short = _short(p, m)
    return tuple(max_in_flight(compute_order(schedule, p, s, short, v)) for s in range(p))


@functools.lru_cache(maxsize=1024)
def head_in_flight(schedule: str, p: int, m: int, v: int) -> int:
    """The most micro-batches the last stage holds the head's activations for at once: those
    in flight on its last model chunk (the one that ends in the head)."""
    return max_in_flight(compute_order(schedule, p, p - 1, _short(p, m), v), chunk=v - 1)


def _link(dev: Device, span: int) -> float:
    """Bytes/s of a group spanning `span` consecutive devices."""
    return dev.intra_bytes_per_s if span <= dev.per_node else dev.inter_bytes_per_s


def _collective_link(dev: Device, stride: int, size: int) -> float:
    """Bus bytes/s of a ring collective (all-reduce, reduce-scatter, all-gather) over `size`
    ranks `stride` apart: on the node's links inside a node; across nodes each node's members
    drive one ring channel each through their own network adapters, so the ring's slowest hop
    runs at members x a device's share of the network (NCCL's bus bandwidth across nodes is the
    node's network bandwidth, not a device's), at most the node's links."""
    if stride * size <= dev.per_node:
        return dev.intra_bytes_per_s
    members = max(1, dev.per_node // stride)
    return min(dev.intra_bytes_per_s, members * dev.inter_bytes_per_s)


def elementwise_bytes(shape: ModelShape, tokens: float, seq: int, st: Step) -> float:
    """Forward element-wise traffic of one block on one rank (bytes read and written)."""
    low = 2 if st.bf16 else 4
    rep = st.tp if st.sp else 1
    h, f = shape.hidden, shape.ffn / st.tp
    if shape.megatron_layer:
        # two LayerNorms (read, write) and two bias-dropout-adds (read 2, write 1, mask 0.5)
        # on the hidden width; bias-GELU (read, write) on 4h/t; QK^T's scores written, softmax
        # read and written, dropout read, written and its mask, AV's read: 6.5 per score.
        scores = 6.5 * shape.heads / st.tp * seq * tokens if st.scores_in_memory else 0.0
        return low * (tokens * ((2 * 2 * h + 2 * 3.5 * h) / rep + 2 * f) + scores)
    q = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / st.tp
    # two norms (read, write), RoPE on q and k, two residual adds (read 2, write 1), the MLP's
    # activation (gated: read 2, write 1; else read 1, write 1)
    mlp = 3 * f if shape.mlp_saved == 4 else 2 * f
    return low * tokens * ((2 * 2 * h + 2 * 3 * h) / rep + 2 * q + mlp)


KINDS = ("matmul", "attention", "memory", "links", "data_parallel")
"""What a step's seconds are spent on: weight GEMMs, the attention core, element-wise and optimizer
memory traffic, tensor/context/expert-parallel collectives and pipeline messages, and the
data-parallel reduction (ZeRO-3: and parameter gathers), each at its `Efficiency` (the last two
at the bandwidth's, the data-parallel share partly hidden under compute)."""


def stage_parts(shape: ModelShape, layers: list[int], st: Step, dev: Device) -> dict[str, float]:
    """One micro-batch's forward and backward through `layers` on one rank, in seconds at the
    device's peaks, by kind (`KINDS`; measured layer times count as "matmul")."""
    peak, hbm = dev.flops(st.bf16), dev.hbm_bytes_per_s
    low = 2 if st.bf16 else 4
    tokens = st.micro_batch * st.seq / st.cp
    tp_link, cp_link = _link(dev, st.tp), _link(dev, st.tp * st.cp)
    ep_link = _link(dev, st.tp * st.cp * st.ep)
    passes = 3 if st.recompute == "full" else 2  # forward, backward, [recomputed forward]
    parts = dict.fromkeys(KINDS, 0.0)
    for layer in layers:
        if st.layer_seconds is not None:
            parts["matmul"] += st.layer_seconds[layer] * (4 / 3 if st.recompute == "full" else 1)
            continue
        fwd = shape.forward_flops(layer, tokens, st.seq) / st.tp
        if layer not in shape.blocks:
            parts["matmul"] += 3 * fwd / peak
            continue
        core = 4.0 * tokens * st.seq * shape.heads * shape.head_dim / st.tp
        # weight GEMMs and the attention core (QK^T, AV) each forward, twice backward, once
        # more when recomputed (selective: the core alone)
        parts["matmul"] += (3 + (st.recompute == "full")) * (fwd - core) / peak
        parts["attention"] += (3 + (st.recompute in ("full", "selective"))) * core / peak
        elem = elementwise_bytes(shape, tokens, st.seq, st)
        memory = 3 * elem + (elem if st.recompute == "full" else 0)
        if st.recompute == "selective" and st.scores_in_memory:
            memory += low * 6.5 * shape.heads / st.tp * st.seq * tokens
        parts["memory"] += memory / hbm
        tp_bytes = 4 * (st.tp - 1) / st.tp * tokens * shape.hidden * low * passes
        kv = 2 * shape.kv_heads * shape.head_dim / st.tp * tokens * low
        cp_bytes = (st.cp - 1) * kv * 3  # K, V forward; K, V and dK, dV backward
        ep_bytes = 0.0
        if st.ep > 1 and shape.layer_experts and shape.layer_experts[layer]:
            rows = tokens / st.tp * shape.top_k * shape.hidden * low  # SP: a tp rank's tokens
            ep_bytes = 2 * rows * (st.ep - 1) / st.ep * passes  # dispatch + combine
        parts["links"] += tp_bytes / tp_link + cp_bytes / cp_link + ep_bytes / ep_link
    return parts


@dataclass(frozen=True)
class StepCost:
    """A step's seconds at the device's peaks, by kind: the busiest stage's micro-batches on the
    schedule's timeline (`repeat` = micro-batches x (1 + bubble) of each stage's `stages` cost),
    then the data-parallel reduction and the optimizer pass (`once`)."""

    stages: tuple[dict[str, float], ...]
    repeat: float
    once: dict[str, float]

    def seconds(self, efficiency: Efficiency) -> float:
        """The step at these efficiencies: each kind's seconds ÷ its efficiency; the overlapped
        share of the data-parallel communication hidden under the pipelined compute as far as
        that lasts."""
        rate = efficiency.of
        busiest = max(sum(v / rate(k) for k, v in parts.items()) for parts in self.stages)
        compute = self.repeat * busiest
        dp = self.once.get("data_parallel", 0.0) / efficiency.bandwidth
        rest = sum(v / rate(k) for k, v in self.once.items() if k != "data_parallel")
        return max(compute + (1 - efficiency.overlap) * dp, dp) + rest


def step_cost(shape: ModelShape, stages: list[list[int]], st: Step, dev: Device) -> StepCost:
    """One step's cost by kind; `stages[s]` lists stage s's layers (all its chunks)."""
    low = 2 if st.bf16 else 4
    tokens = st.micro_batch * st.seq / st.cp
    per_stage = [stage_parts(shape, layers, st, dev) for layers in stages]
    if st.pp > 1:
        message = tokens * shape.hidden * low / (st.tp if st.sp or st.scatter_gather else 1)
        p2p = 2 * st.virtual * message / _link(dev, st.tp * st.cp * st.dp * 2)
        for parts in per_stage:
            parts["links"] += p2p
    repeat = st.micro_batches * (
        1 + schedule_bubble(st.schedule, st.pp, st.micro_batches, st.virtual)
    )
    # the busiest stage's dense parameters (split over tp) and routed experts (over ep)
    psi, experts = max(
        (
            (sum(shape.layer_params[i] for i in layers) - shape.experts_of(layers)) / st.tp,
            shape.experts_of(layers) / st.ep,
        )
        for layers in stages
    )
    nd = st.dp * st.cp
    grad_bytes = 4 if not st.bf16 or st.zero == 0 else low
    reduce = 0.0  # seconds; a rank's experts are reduced over the ranks ep apart
    for count, ranks, stride in ((psi, nd, st.tp), (experts, nd // st.ep, st.tp * st.ep)):
        if ranks > 1 and st.zero == 3:  # reduce-scatter once; gather each forward and backward
            volume = (ranks - 1) / ranks * count * (grad_bytes + 2 * st.micro_batches * low)
        else:
            volume = 2 * (ranks - 1) / ranks * count * grad_bytes
        reduce += volume / _collective_link(dev, stride, ranks)
    states = (psi / nd + experts / (nd // st.ep)) if st.zero >= 1 else psi + experts
    once = {"data_parallel": reduce, "memory": states * OPTIMIZER_BYTES / dev.hbm_bytes_per_s}
    return StepCost(tuple(per_stage), repeat, once)


def step_seconds(shape: ModelShape, stages: list[list[int]], st: Step, dev: Device) -> float:
    """One step: the pipelined micro-batches, then the data-parallel reduction and the
    optimizer, at the device's efficiencies."""
    return step_cost(shape, stages, st, dev).seconds(dev.efficiency)


def uniform_stages(shape: ModelShape, pp: int, virtual: int = 1) -> list[list[int]]:
    """Megatron's split: the blocks evenly over the pp x v chunks, the embedding with the first,
    the final norm and head with the last; stage s holds chunks s, s + pp, ... ."""
    chunks = pp * virtual
    blocks = list(shape.blocks)
    if len(blocks) % chunks:
        raise ValueError(f"{len(blocks)} blocks do not divide into {chunks} chunks")
    per = len(blocks) // chunks
    layers = [blocks[c * per : (c + 1) * per] for c in range(chunks)]
    layers[0] = [i for i in range(len(shape.layer_params)) if i < blocks[0]] + layers[0]
    layers[-1] += [i for i in range(len(shape.layer_params)) if i > blocks[-1]]
    return [sum((layers[c] for c in range(s, chunks, pp)), []) for s in range(pp)]
