"""The plan of a run: everything about how the model is laid out and stepped, resolved once from
the config and world size before any process group starts, and used by everything after it —
`dsnd train`, `dsnd launch` and its dry run, checkpoints, `dsnd bench` and the tests.

A `Plan` is pure data: the topology, the stage boundaries (over ``pp * virtual_stages`` virtual
stages), the ZeRO stage, tensor and sequence parallelism, which stages a tied weight joins, and
each pipeline stage's whole program of instructions (`dsnd.plan.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsnd.errors import UserError
from dsnd.model import layer_specs, param_groups
from dsnd.model.count import expert_table, layer_table
from dsnd.model.layer_spec import TiedLayerSpec
from dsnd.model.moe_config import EXPERT_WEIGHTS
from dsnd.model.source import ModelSpec
from dsnd.plan.partition import PartitionMethod, partition
from dsnd.plan.schedule import (
    COMPUTE,
    MULTI_CHUNK,
    SPLIT_BACKWARD,
    Instr,
    StageRole,
    bubble,
    chart,
    compute_order,
    max_in_flight,
    program,
    timeline,
)
from dsnd.topology import Topology

ZERO_STAGES = {
    "1f1b": (0, 1, 2, 3),
    "gpipe": (0, 1, 2, 3),
    "interleaved-1f1b": (0, 1, 2, 3),
    "zb-h1": (0, 1, 2),
}
"""ZeRO stages each schedule runs. ZB-H1's weight-gradient pass writes `.grad` itself, after the
input-gradient pass. ZeRO 0-2 reduce what `.grad` holds at the step's end (ZeRO 1-2 inside
`coalesce_grad_reduction`, whose flush reads `.grad`): parity at dp=2 in
`tests/distributed/test_parity_schedules.py::test_four_stages_and_tensor_parallel`. ZeRO-3
gathers a layer's parameters for its backward and releases them after it, so the later weight
pass finds them empty (torch then raises "attempting to assign a gradient of size [64, 64] to
a tensor of size [0]"); running it would need ZeRO-3's gather/release hooks around the weight
pass."""


@dataclass(frozen=True)
class Tie:
    """A weight two stages use (GPT-2's embedding and head): `owner` holds it, `borrower`
    gets it each step (dsnd.pipeline.tied)."""

    key: str
    owner: int
    borrower: int


@dataclass(frozen=True)
class Plan:
    topology: Topology
    schedule: str
    chunks: int  # v: model chunks per pipeline stage (virtual stages = pp * v)
    micro_batches: int  # per optimizer step and data-parallel rank (DeepSpeed's gas)
    parts: tuple[int, ...]  # virtual stage vs holds global layers parts[vs] .. parts[vs + 1] - 1
    zero_stage: int
    sequence_parallel: bool
    ties: tuple[Tie, ...]
    programs: tuple[tuple[Instr, ...], ...]  # one per pipeline stage

    @property
    def pp(self) -> int:
        return self.topology.pp

    def chunk_layers(self, stage: int, chunk: int) -> list[int]:
        vs = chunk * self.pp + stage
        return list(range(self.parts[vs], self.parts[vs + 1]))

    def stage_layers(self, stage: int) -> list[int]:
        """Every global layer pipeline stage `stage` holds, over its chunks, ascending."""
        return [i for c in range(self.chunks) for i in self.chunk_layers(stage, c)]

    def stage_parameters(self, model: ModelSpec) -> list[int]:
        """Parameters each pipeline stage holds, over its chunks (a tied weight on its owner
        only: `layer_table` counts a tied head 0)."""
        counts = {index: n for index, _, n in layer_table(model)}
        return [sum(counts[i] for i in self.stage_layers(s)) for s in range(self.pp)]

    def stage_experts(self, model: ModelSpec) -> list[int]:
        """Of `stage_parameters`, those of routed experts (what `parallel.ep` splits)."""
        counts = expert_table(model)
        return [sum(counts.get(i, 0) for i in self.stage_layers(s)) for s in range(self.pp)]

    def stage_of_layer(self, index: int) -> int:
        vs = next(v for v in range(len(self.parts) - 1) if index < self.parts[v + 1])
        return vs % self.pp

    def role(self, stage: int) -> StageRole:
        tie = None
        for t in self.ties:
            tie = "owner" if stage == t.owner else "borrower" if stage == t.borrower else tie
        return StageRole(stage, self.pp, self.chunks, tie, sp_sum=self.topology.tp > 1)

    def describe(self, width: int = 96) -> list[str]:
        """What `dsnd launch --dry-run` prints: layout, stages and the schedule's timeline."""
        t = self.topology
        roles = [self.role(s) for s in range(self.pp)]
        rows = timeline([list(p) for p in self.programs], roles)
        lines = [
            f"plan: pp={t.pp} dp={t.dp}"
            + f" cp={t.cp}" * (t.cp > 1)
            + f" tp={t.tp}{' (sequence parallel)' * self.sequence_parallel}"
            f", ZeRO-{self.zero_stage}, schedule {self.schedule}"
            + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
            + f", {self.micro_batches} micro-batches per step",
        ]
        for s in range(self.pp):
            chunks = [self.chunk_layers(s, c) for c in range(self.chunks)]
            held = ", ".join(f"{c[0]}..{c[-1]}" for c in chunks)
            compute = [x for x in self.programs[s] if x.op in COMPUTE]
            lines.append(
                f"  stage {s}: layers {held}; {len(self.programs[s])} instructions, at "
                f"most {max_in_flight(compute)} micro-batch chunks in flight"
            )
        for tie in self.ties:
            lines.append(
                f"  tied '{tie.key}': stage {tie.owner} owns it, stage {tie.borrower} "
                "borrows it each step"
            )
        lines.append(f"  bubble at unit costs (F=1, B=2 or I=W=1): {bubble(rows):.3f} of busy time")
        return lines + ["  " + line for line in chart(rows, width)]


def plan_json(plan: Plan) -> dict:
    """The plan as JSON data (`dsnd launch --dry-run --json`)."""
    roles = [plan.role(s) for s in range(plan.pp)]
    rows = timeline([list(p) for p in plan.programs], roles)
    return {
        "schedule": plan.schedule,
        "virtual_stages": plan.chunks,
        "micro_batches": plan.micro_batches,
        "parts": list(plan.parts),
        "zero_stage": plan.zero_stage,
        "sequence_parallel": plan.sequence_parallel,
        "ties": [t.__dict__ for t in plan.ties],
        "programs": [[str(x) for x in p] for p in plan.programs],
        "bubble_unit_costs": round(bubble(rows), 6),
    }


def make_plan(
    model: ModelSpec,
    topology: Topology,
    *,
    schedule: str,
    virtual_stages: int,
    partition_method: PartitionMethod,
    micro_batches: int,
    zero_stage: int,
    sequence_parallel: bool,
    balance_profile: Callable[[int], list[int]] | None = None,
    sub_group_size: int | None = None,
    expert_parallel: int = 1,
) -> Plan:
    """Resolve and check the plan; every refusal is a UserError naming the key and numbers.

    ``partition: profile`` calls `balance_profile(stages)` (measured costs, `dsnd.plan.profile`).
    `sub_group_size` is the JSON's ZeRO-3 `sub_group_size` (None: DeepSpeed's default);
    `expert_parallel` is `parallel.ep` (the experts then get a parameter group of their own).
    """
    p, v = topology.pp, virtual_stages
    _check_schedule(schedule, p, v, micro_batches, zero_stage)
    specs = layer_specs(model)
    chunks = f"parallel.pp={p} x parallel.virtual_stages={v} = {p * v} model chunks" * (v > 1)
    parts = tuple(partition(partition_method, specs, p * v, balance_profile, chunks))
    ties = _ties(specs, parts, p)
    plan = Plan(
        topology,
        schedule,
        v,
        micro_batches,
        parts,
        zero_stage,
        sequence_parallel and topology.tp > 1,
        ties,
        programs=(),
    )
    roles = [plan.role(s) for s in range(p)]
    programs = tuple(
        tuple(program(compute_order(schedule, p, s, micro_batches, v), roles[s])) for s in range(p)
    )
    plan = Plan(**{**plan.__dict__, "programs": programs})
    _check_param_groups(plan, specs, partition_method, expert_parallel)
    _check_zero3_sub_groups(
        plan, model, ZERO3_SUB_GROUP if sub_group_size is None else sub_group_size
    )
    return plan


ZERO3_SUB_GROUP = 1_000_000_000  # DeepSpeed's default sub_group_size


def _check_zero3_sub_groups(plan: Plan, model: ModelSpec, size: float) -> None:
    """ZeRO-3 steps its parameters in sub-groups of `sub_group_size` elements, with collectives
    per sub-group over the model-parallel group; stages holding different numbers of them wait
    on each other for ever (observed, not in the suite: `sub_group_size: 0`, axolotl's ZeRO-3
    JSON, hangs at pp=2 in the first step, and runs at pp=1; `tests/distributed/test_ds_corpus.py`
    sees it refused). Refused unless every stage fits one sub-group."""
    if plan.pp == 1 or plan.zero_stage != 3:
        return
    largest = max(plan.stage_parameters(model))
    if size < largest:
        raise UserError(
            f"zero_optimization.sub_group_size={size:g} splits a pipeline stage's {largest:,} "
            "parameters into ZeRO-3 sub-groups whose number differs between stages, and "
            "DeepSpeed's per-sub-group collectives then hang (measured at pp=2); set it to at "
            f"least {largest} (DeepSpeed's default is {ZERO3_SUB_GROUP:g})"
        )


def _check_schedule(schedule: str, p: int, v: int, m: int, zero: int) -> None:
    key = "parallel.virtual_stages"
    if v < 1:
        raise UserError(f"{key}={v} must be >= 1")
    if schedule in MULTI_CHUNK:
        if p < 2 or v < 2:
            raise UserError(
                f"parallel.schedule={schedule} needs parallel.pp >= 2 and {key} >= 2 "
                f"(got pp={p}, {key}={v}; with one chunk it is 1f1b)"
            )
        if m % p:
            raise UserError(
                f"parallel.schedule={schedule} needs the micro-batches per step "
                f"(gradient_accumulation_steps={m}) to be a multiple of "
                f"parallel.pp={p}"
            )
    elif v != 1:
        raise UserError(f"{key}={v} needs parallel.schedule=interleaved-1f1b (got {schedule})")
    if zero not in ZERO_STAGES[schedule]:
        runs = ", ".join(str(z) for z in ZERO_STAGES[schedule])
        why = " (ZeRO-3 releases a layer's gathered parameters before the weight pass)" * (
            schedule in SPLIT_BACKWARD
        )
        raise UserError(
            f"parallel.schedule={schedule} runs with ZeRO stages {runs}, not "
            f"zero_optimization.stage={zero}{why}"
        )


def _ties(specs: list, parts: tuple[int, ...], p: int) -> tuple[Tie, ...]:
    stage_of = {i: vs % p for vs in range(len(parts) - 1) for i in range(parts[vs], parts[vs + 1])}
    positions: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            positions.setdefault(spec.key, []).append(i)
    ties = []
    for key, where in positions.items():
        stages = list(dict.fromkeys(stage_of[i] for i in where))
        if len(stages) > 2:
            raise UserError(
                f"tied weight '{key}' would span pipeline stages {stages}; dsnd ties two stages"
            )
        if len(stages) == 2:
            ties.append(Tie(key, owner=stages[0], borrower=stages[1]))
    return tuple(ties)


def _check_param_groups(plan: Plan, specs: list, method: PartitionMethod, ep: int) -> None:
    """Under ZeRO 1-3 DeepSpeed all-reduces the gradient norm once per parameter group over the
    model-parallel group, so every stage needs the same number of groups (decayed and undecayed
    parameters; with `ep` > 1 also the routed experts, which ZeRO keeps in a group of their own:
    `dsnd.engine.experts`), or the stages would wait on each other for ever."""
    if plan.pp == 1 or plan.zero_stage == 0:
        return
    counts, owned = [], set()
    for stage in range(plan.pp):
        modules = torch.nn.ModuleList()
        with torch.device("meta"):
            for i in plan.stage_layers(stage):
                key = getattr(specs[i], "key", None)
                if key is None or key not in owned:
                    modules.append(specs[i].build())
                    owned.add(key)
        experts = ep > 1 and any(EXPERT_WEIGHTS.search(n) for n, _ in modules.named_parameters())
        counts.append(len(param_groups(modules)) + experts)
    if len(set(counts)) > 1:
        raise UserError(
            f"parallel.partition={method!r} gives stages {list(plan.parts)} whose "
            f"optimizer parameter groups differ ({counts} per stage: decayed matrices and/or "
            f"undecayed norms, biases, embeddings"
            + (f"; with parallel.ep={ep} the routed experts, which some stages lack" * (ep > 1))
            + f"); with ZeRO-{plan.zero_stage} DeepSpeed reduces the gradient norm per group "
            "across stages, which would hang: choose a partition where every stage holds a "
            + ("MoE block" if ep > 1 else "transformer block")
            + (" (e.g. 'parameters')" if method != "parameters" else " (explicit boundaries)")
        )
