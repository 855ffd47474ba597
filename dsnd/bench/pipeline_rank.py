"""Rank program of ``dsnd bench pipeline``; run by every rank of a 2-rank gloo world::

    python -m dsnd.bench.pipeline_rank OUT.json [--steps N] [--warmup W] [--micro-batches M]

Phase 1, pp=2 x dp=1: dsnd's `StageRunner` (exactly what the trainer runs each step) and
DeepSpeed's `PipelineEngine` with ZeRO-1 are built side by
side in these processes from the same layer specs, initial weights, DeepSpeed dict and partition
method, and take turns on the same global batches (`batch_for_step`): repetition r runs step r on
both, in alternating order, each timed from a common barrier to its end on every rank.
Phase 2, pp=1 x dp=2: a ZeRO-1 and then a ZeRO-3 engine; after one full step (Adam's state
exists) and one more micro-batch backward (gradients accumulating), the model-state bytes each
holds on each rank.

Rank 0 writes the raw numbers to OUT.json; `dsnd.bench.results` turns them into rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsnd.bench.results import WORLD
from dsnd.config.load import default_config_path, load
from dsnd.config.resolve import Resolved, resolve
from dsnd.data import SampleSet, batch_for_step, load_corpus
from dsnd.distributed.groups import ProcessGroups, build_groups
from dsnd.distributed.init import init_world, shutdown, world_info
from dsnd.distributed.mpu import Mpu
from dsnd.engine.build import build_engine
from dsnd.model import init_layer, layer_specs, lm_loss, param_groups
from dsnd.pipeline.partition import layer_param_counts
from dsnd.pipeline.runner import StageRunner
from dsnd.pipeline.stage import build_stage

PIPE_SETS = ("parallel.pp=2", "parallel.schedule=1f1b", "parallel.partition=parameters")
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _ds_json(stage: int) -> str:
    return os.path.join(os.path.dirname(default_config_path()), f"zero{stage}.json")


def configs(world: int, micro_batches: int) -> dict[str, Resolved]:
    """The three resolved runs: the pipeline layout and the two ZeRO layouts (pp=1)."""
    pipe = [
        f"deepspeed={_ds_json(1)}",
        *PIPE_SETS,
        "ds.train_batch_size=null",  # micro (from the JSON) x gas x dp
        f"ds.gradient_accumulation_steps={micro_batches}",
    ]
    return {
        "pipe": resolve(load(None, pipe), world),
        "zero1": resolve(load(None, [f"deepspeed={_ds_json(1)}"]), world),
        "zero3": resolve(load(None, [f"deepspeed={_ds_json(3)}"]), world),
    }


def _samples(res: Resolved) -> SampleSet:
    data = res.run.data
    corpus = load_corpus(data.path, data.format, data.text_field, data.max_bytes)
    return SampleSet(corpus.tokens, res.run.model.seq_len, name=corpus.name)


def _batches(res: Resolved, samples: SampleSet, groups: ProcessGroups, step: int) -> Batches:
    b = res.batch
    return batch_for_step(
        samples, res.run.train.seed, step, b.train, groups.coord.dp, res.topology.dp, b.micro
    )


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

    def step(self, micro: Batches) -> dict[str, float]:
        """One optimizer step: the stage's own time (`stage_s`), its receive waits, and the time
        until every stage knows the loss (`step_s`, like DeepSpeed's train_batch)."""
        dist.barrier()
        start = time.perf_counter()
        result = self.runner.run(micro)
        stage_s = time.perf_counter() - start
        loss, _ = self.runner.report(result)
        step_s = time.perf_counter() - start
        return {"stage_s": stage_s, "step_s": step_s, "loss": loss,
                "wait_s": result.times["pipeline_wait"]}  # fmt: skip


def deepspeed_pipeline(res: Resolved):
    """DeepSpeed's side: `PipelineModule` over dsnd's layer specs, with dsnd's initial weights,
    partition method and topology, in a `PipelineEngine` with the same DeepSpeed dict."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(
        layers=layer_specs(res.model),
        num_stages=res.topology.pp,
        topology=res.topology.to_deepspeed(),
        loss_fn=lm_loss,
        partition_method=res.run.parallel.partition,
    )
    with torch.no_grad():  # the layers DeepSpeed built get dsnd's (seed, index, name) weights
        for name, layer in module.named_children():
            if name.isdigit():
                init_layer(layer, res.run.train.seed, int(name), layer.init_std)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=param_groups(module),
        config=copy.deepcopy(res.ds),
        dist_init_required=False,
    )
    return engine


def deepspeed_step(engine, micro: Batches) -> dict[str, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = engine.train_batch(iter(micro))
    step_s = time.perf_counter() - start
    return {"step_s": step_s, "loss": float(loss)}


def bench_pipeline(res: Resolved, steps: int, warmup: int) -> list[dict[str, Any]]:
    """This rank's records of `steps` timed repetitions (after `warmup` untimed ones)."""
    groups = build_groups(res.topology)
    samples = _samples(res)
    ours = DsndPipeline(res, groups)
    theirs = deepspeed_pipeline(res)
    records = []
    try:
        for rep in range(warmup + steps):
            micro = _batches(res, samples, groups, rep)
            if rep % 2 == 0:
                mine, ds = ours.step(micro), deepspeed_step(theirs, micro)
                order = "dsnd-first"
            else:
                ds, mine = deepspeed_step(theirs, micro), ours.step(micro)
                order = "deepspeed-first"
            records.append(
                {"rep": rep, "timed": rep >= warmup, "order": order, "dsnd": mine, "deepspeed": ds}
            )
    finally:
        theirs.destroy()
        ours.engine.destroy()
    return records


def zero_state(res: Resolved) -> dict[str, int]:
    """Model-state bytes on this rank of a pp=1 engine, with gradients accumulating and Adam's
    state created (one full step done, then one micro-batch of the next)."""
    from dsnd.engine.memory import state_bytes

    groups = build_groups(res.topology)
    samples = _samples(res)
    torch.manual_seed(res.run.train.seed)
    stack = build_stage(res, groups)
    engine = build_engine(stack, res.ds, param_groups(stack), Mpu(groups))
    counted = None
    try:
        for step in range(2):
            for i, (x, y) in enumerate(_batches(res, samples, groups, step)):
                engine.backward(lm_loss(engine(x.to(engine.device)), y.to(engine.device)))
                if step == 1 and i == 0:
                    counted = state_bytes(engine)
                engine.step()
    finally:
        engine.destroy()
    assert counted is not None
    return counted


def _merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per repetition with per-rank lists: {"dsnd": {"step_s": [r0, r1], ...}}."""
    reps = []
    for records in zip(*per_rank, strict=True):
        rep = {k: records[0][k] for k in ("rep", "timed", "order")}
        for side in ("dsnd", "deepspeed"):
            keys = records[0][side]
            rep[side] = {k: [r[side][k] for r in records] for k in keys if k != "loss"}
            rep[side]["loss"] = records[-1][side]["loss"]  # every rank has the last stage's
        reps.append(rep)
    return reps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dsnd.bench.pipeline_rank")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    info = world_info(dict(os.environ))
    logging.basicConfig(level=logging.WARNING, format=f"[r{info.rank}] %(levelname)s %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if info.world_size != WORLD:
        raise SystemExit(f"dsnd bench pipeline runs on {WORLD} ranks, got {info.world_size}")
    res = configs(info.world_size, args.micro_batches)
    init_world(info, timeout_s=300)
    try:
        records = bench_pipeline(res["pipe"], args.steps, args.warmup)
        zero = {"1": zero_state(res["zero1"]), "3": zero_state(res["zero3"])}
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, {"records": records, "zero": zero})
    finally:
        shutdown()
    if info.rank != 0:
        return
    pipe = res["pipe"]
    raw = {
        "layout": {
            "pp": pipe.topology.pp,
            "dp": pipe.topology.dp,
            "micro": pipe.batch.micro,
            "gas": pipe.batch.gas,
            "seq_len": pipe.run.model.seq_len,
            "preset": pipe.run.model.preset,
            "partition": pipe.run.parallel.partition,
            "tokens_per_step": pipe.tokens_per_step,
            "warmup": args.warmup,
        },
        "reps": _merge([g["records"] for g in gathered]),
        "zero": {
            "psi": sum(layer_param_counts(layer_specs(res["zero1"].model))),
            "nd": res["zero1"].topology.dp,
            **{stage: [g["zero"][stage] for g in gathered] for stage in ("1", "3")},
        },
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(raw, f)


if __name__ == "__main__":
    main()
