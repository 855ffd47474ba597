"""Rank program of ``dsnd bench pipeline``; run by every rank of a gloo world::

    python -m dsnd.bench.pipeline_rank OUT.json [--steps N] [--warmup W] [--micro-batches M]
                                                [--phase pipeline|pp4]

Phase ``pipeline`` (2 ranks):

1. pp=2 x dp=1: dsnd's `StageRunner` (exactly what the trainer runs each step) and DeepSpeed's
   `PipelineEngine` with ZeRO-1 are built side by side in these processes from the same layer
   specs, initial weights, DeepSpeed dict and partition method, and take turns on the same
   global batches (`batch_for_step`): repetition r runs step r on both, in alternating order,
   each timed from a common barrier to its end on every rank.
2. pp=2 x dp=1, schedules: one `StageRunner` per schedule (1F1B, interleaved 1F1B with v=2,
   ZB-H1), built from the same config but for ``parallel.schedule`` (and
   ``parallel.virtual_stages``), take turns in the same way, in rotating order; each step
   records its stage time, receive waits, optimizer time and seconds per compute instruction
   kind (`StepResult.op_seconds`), and the plan's programs are kept so that
   `dsnd.bench.schedule_results` can replay them at the measured costs.

Phase ``pp4`` (4 ranks): steps 1 and 2 at pp=4, on a model with 8 transformer blocks
(interleaving needs 8 virtual stages of at least one layer each).

After step 1 each phase measures the one-way latency of an activation-sized message between
stages 0 and 1 (`message_latency`), which `dsnd.bench.results` uses to replay the 1F1B step at
this machine's measured costs.

Rank 0 writes the raw numbers to OUT.json; `dsnd.bench.results` turns them into rows.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsnd.bench import rank
from dsnd.bench.results import PP4_WORLD, WORLD
from dsnd.bench.rows import median
from dsnd.bench.schedule_results import BASELINE
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import ProcessGroups, run_groups
from dsnd.engine.deepspeed_api import pipe_topology
from dsnd.engine.pipe import pipeline_engine, pipeline_module
from dsnd.model import init_layer, layer_specs, lm_loss, param_groups
from dsnd.pipeline.executor import Batches
from dsnd.pipeline.runner import StageRunner
from dsnd.plan.schedule import MULTI_CHUNK

PIPE_SETS = ("parallel.pp=2", "parallel.schedule=1f1b", "parallel.partition=parameters")
SCHEDULES = {BASELINE: (), "interleaved-1f1b": ("parallel.virtual_stages=2",), "zb-h1": ()}
"""The schedules compared, each with its extra settings; 1F1B (the baseline) first."""
PP4_MODEL = ("model.num_layers=8",)  # 11 pipeline layers: enough for pp=4 x v=2 virtual stages


def _pipe_sets(micro_batches: int) -> list[str]:
    return [
        f"deepspeed={rank.ds_json(1)}",
        *PIPE_SETS,
        "ds.train_batch_size=null",  # micro (from the JSON) x gas x dp
        f"ds.gradient_accumulation_steps={micro_batches}",
    ]


def configs(world: int, micro_batches: int, extra: Sequence[str] = ()) -> dict[str, Resolved]:
    """The resolved pipeline layout; `extra` (--set items, e.g. a wider model) applies."""
    return {"pipe": resolve(load(None, [*_pipe_sets(micro_batches), *extra]), world)}


def schedule_configs(
    world: int, pp: int, micro_batches: int, extra: Sequence[str] = ()
) -> dict[str, Resolved]:
    """One resolved run per schedule of `SCHEDULES`, identical (model, ZeRO-1 JSON, partition,
    batch) but for the schedule's own keys. Interleaving is left out when the micro-batches are
    not a multiple of `pp` (it needs whole rounds of pp micro-batches)."""
    base = [*_pipe_sets(micro_batches), f"parallel.pp={pp}", *extra]
    return {
        name: resolve(load(None, [*base, f"parallel.schedule={name}", *sets]), world)
        for name, sets in SCHEDULES.items()
        if name not in MULTI_CHUNK or micro_batches % pp == 0
    }


@dataclass
class DsndPipeline:
    """dsnd's side: this rank's stage engine and the pieces the trainer's step uses."""

    res: Resolved
    groups: ProcessGroups

    def __post_init__(self) -> None:
        torch.manual_seed(self.res.run.train.seed)
        self.runner = StageRunner(self.res, self.groups)
        self.engine = self.runner.engine
        self.links = self.runner.links

    def step(self, micro: Batches) -> dict[str, Any]:
        """One optimizer step: the stage's own time (`stage_s`); its pipelined part (`pipe_s`:
        to the start of the gradient reduction, after every compute instruction, message and
        tied exchange); its receive waits (`wait_s`), optimizer step (`optimizer_s`), seconds
        per phase (`times`) and per compute instruction kind (`ops`); and the time until every
        stage knows the loss (`step_s`, like DeepSpeed's train_batch); and the seconds of each
        instruction of the program (`instr_s`)."""
        dist.barrier()
        start = time.perf_counter()
        result = self.runner.run(micro)
        stage_s = time.perf_counter() - start
        loss, _ = self.runner.report(result)
        step_s = time.perf_counter() - start
        times = result.times
        return {
            "stage_s": stage_s,
            "step_s": step_s,
            "loss": loss,
            "pipe_s": result.pipelined_s,
            "wait_s": times["pipeline_wait"],
            "optimizer_s": times["optimizer"],
            "times": dict(times),
            "ops": dict(result.op_seconds),
            "instr_s": result.instr_seconds,
        }


def deepspeed_pipeline(res: Resolved):
    """DeepSpeed's side: `PipelineModule` over dsnd's layer specs, with dsnd's initial weights,
    partition method and topology, in a `PipelineEngine` with the same DeepSpeed dict."""
    module = pipeline_module(
        layer_specs(res.model),
        num_stages=res.topology.pp,
        topology=pipe_topology(res.topology.pp, res.topology.tp, res.topology.dp),
        loss_fn=lm_loss,
        partition_method=res.run.parallel.partition,
    )
    with torch.no_grad():  # the layers DeepSpeed built get dsnd's (seed, index, name) weights
        for name, layer in module.named_children():
            if name.isdigit():
                init_layer(layer, res.run.train.seed, int(name), layer.init_std)
    return pipeline_engine(module, param_groups(module), copy.deepcopy(res.ds))


def deepspeed_step(engine, micro: Batches) -> dict[str, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = engine.train_batch(iter(micro))
    step_s = time.perf_counter() - start
    return {"step_s": step_s, "loss": float(loss)}


LATENCY_ROUNDS = 64  # round trips of the message-latency probe


def message_latency(
    groups: ProcessGroups, shape: Any, device: torch.device, rounds: int = LATENCY_ROUNDS
) -> float:
    """Seconds from a send to its arrival between stages 0 and 1 of this rank's pipeline, with
    both blocked waiting for it (the cheapest a message gets here): the median round trip of one
    activation-sized tensor / 2. The other stages wait; every stage returns the same number."""
    stage, pipe = groups.coord.pp, groups.pipe
    out = torch.zeros((), dtype=torch.float64, device=device)
    if stage < 2:
        peer = dist.get_process_group_ranks(pipe)[1 - stage]
        x = torch.zeros(shape.activation, dtype=shape.dtype, device=device)
        trips = []
        for _ in range(rounds):
            start = time.perf_counter()
            if stage == 0:
                dist.send(x, peer, group=pipe)
                dist.recv(x, peer, group=pipe)
            else:
                dist.recv(x, peer, group=pipe)
                dist.send(x, peer, group=pipe)
            trips.append(time.perf_counter() - start)
        out.fill_(median(trips) / 2)
    dist.broadcast(out, src=dist.get_process_group_ranks(pipe)[0], group=pipe)
    return float(out)


def bench_pipeline(res: Resolved, steps: int, warmup: int) -> dict[str, Any]:
    """This rank's records of `steps` timed repetitions (after `warmup` untimed ones), and the
    one-way latency of a message between stages 0 and 1 (`message_latency`, after them)."""
    groups = run_groups(res)
    samples = rank.sample_set(res)
    ours = DsndPipeline(res, groups)
    theirs = deepspeed_pipeline(res)
    records = []
    try:
        for rep in range(warmup + steps):
            micro = rank.step_batches(res, samples, groups, rep)
            if rep % 2 == 0:
                mine, ds = ours.step(micro), deepspeed_step(theirs, micro)
                order = "dsnd-first"
            else:
                ds, mine = deepspeed_step(theirs, micro), ours.step(micro)
                order = "deepspeed-first"
            records.append(
                {"rep": rep, "timed": rep >= warmup, "order": order, "dsnd": mine, "deepspeed": ds}
            )
        latency = message_latency(groups, ours.runner.shape, ours.runner.engine.device)
    finally:
        theirs.destroy()
        ours.engine.destroy()
    return {"records": records, "latency_s": latency}


def bench_schedules(runs: dict[str, Resolved], steps: int, warmup: int) -> list[dict[str, Any]]:
    """This rank's records of `steps` timed repetitions (after `warmup` untimed ones) of every
    schedule in `runs`, one `StageRunner` each, all in these processes: repetition r runs step
    r's batches on each, starting from schedule r mod k, each timed from a common barrier."""
    first = next(iter(runs.values()))
    groups = run_groups(*runs.values())
    samples = rank.sample_set(first)
    pipelines: dict[str, DsndPipeline] = {}
    try:
        for name, res in runs.items():
            pipelines[name] = DsndPipeline(res, groups)
        return rank.take_turns(
            list(pipelines),
            steps,
            warmup,
            lambda rep: rank.step_batches(first, samples, groups, rep),
            lambda name, micro: pipelines[name].step(micro),
        )
    finally:
        for pipeline in pipelines.values():
            pipeline.engine.destroy()


def plan_record(res: Resolved) -> dict[str, Any]:
    """What `dsnd.bench.schedule_results` needs to replay a run's schedule: its programs as
    (op, micro, chunk) triples and its stages' roles."""
    plan = res.plan
    return {
        "virtual_stages": plan.chunks,
        "programs": [[[x.op, x.micro, x.chunk] for x in program] for program in plan.programs],
        "roles": [asdict(plan.role(s)) for s in range(plan.pp)],
    }


def schedule_section(
    runs: dict[str, Resolved], per_rank: list[list[dict[str, Any]]], warmup: int
) -> dict[str, Any]:
    """The raw JSON of a schedule phase: layout, each schedule's plan, merged repetitions."""
    base = runs[BASELINE]
    return {
        "layout": {
            "pp": base.topology.pp,
            "micro_batches": base.batch.gas,
            "tokens_per_step": base.tokens_per_step,
            "warmup": warmup,
            "ranks": len(per_rank),
            "cores": os.cpu_count(),
            "model": base.model.source,
            "layers": base.model.num_layers,
        },
        "plans": {name: plan_record(res) for name, res in runs.items()},
        "reps": merge_runs(list(runs), per_rank),
    }


def merge_runs(names: list[str], per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per repetition of runs taking turns, each run's numbers as per-rank lists."""
    reps = []
    for records in zip(*per_rank, strict=True):
        rep = {k: records[0][k] for k in ("rep", "timed", "order")}
        rep["runs"] = {name: _per_rank([r["runs"][name] for r in records]) for name in names}
        reps.append(rep)
    return reps


def _per_rank(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's records of every rank as per-rank lists, but one loss (every rank has the
    last stage's)."""
    out = {k: [r[k] for r in records] for k in records[0] if k != "loss"}
    out["loss"] = records[-1]["loss"]
    return out


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per repetition with per-rank lists: {"dsnd": {"step_s": [r0, r1], ...}}."""
    reps = []
    for records in zip(*per_rank, strict=True):
        rep = {k: records[0][k] for k in ("rep", "timed", "order")}
        for side in ("dsnd", "deepspeed"):
            rep[side] = _per_rank([r[side] for r in records])
        reps.append(rep)
    return reps


def pipeline_configs(world: int, micro_batches: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    schedules = schedule_configs(world, 2, micro_batches, extra)
    return {**configs(world, micro_batches, extra), "schedules": schedules}


def pipeline_phase(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Phase ``pipeline`` or ``pp4``: steps 1-2 of the module docstring; the raw JSON, of every
    rank's records."""
    runs, world = res["schedules"], res["pipe"].topology.world_size
    pipeline = bench_pipeline(res["pipe"], args.steps, args.warmup)
    schedules = bench_schedules(runs, args.steps, args.warmup)
    gathered = rank.gather({"records": pipeline["records"], "schedules": schedules})
    pipe = res["pipe"]
    return {
        "layout": {
            "pp": pipe.topology.pp,
            "dp": pipe.topology.dp,
            "micro": pipe.batch.micro,
            "gas": pipe.batch.gas,
            "seq_len": pipe.run.model.seq_len,
            "preset": pipe.run.model.preset or pipe.model.source,
            "partition": pipe.run.parallel.partition,
            "tokens_per_step": pipe.tokens_per_step,
            "warmup": args.warmup,
            "ranks": world,
            "cores": os.cpu_count(),
        },
        "reps": _merge([g["records"] for g in gathered]),
        "plan": plan_record(pipe),
        "latency_s": pipeline["latency_s"],
        "schedules": schedule_section(runs, [g["schedules"] for g in gathered], args.warmup),
    }


def pp4_configs(world: int, micro_batches: int, extra: Sequence[str] = ()) -> dict[str, Any]:
    """The pp=4 runs (a model of `PP4_MODEL`): the layout against DeepSpeed and the schedules."""
    extra = [*PP4_MODEL, *extra]
    pipe = configs(world, micro_batches, ["parallel.pp=4", *extra])
    return {**pipe, "schedules": schedule_configs(world, 4, micro_batches, extra)}


PHASES = {
    "pipeline": (WORLD, pipeline_configs, pipeline_phase),
    "pp4": (PP4_WORLD, pp4_configs, pipeline_phase),
}
"""Each phase's ranks, its resolved runs, and what it runs on them."""


def main(argv: list[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.pipeline_rank", steps=40, warmup=10)
    parser.add_argument("--phase", choices=tuple(PHASES), default="pipeline")
    args = parser.parse_args(argv)
    world, resolve_runs, phase = PHASES[args.phase]
    rank.run(
        args.out,
        f"dsnd bench pipeline's {args.phase} phase",
        world,
        lambda: resolve_runs(world, args.micro_batches, args.sets),
        lambda runs: phase(runs, args),
    )


if __name__ == "__main__":
    main()
