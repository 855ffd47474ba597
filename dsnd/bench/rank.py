"""What every bench rank program (`dsnd.bench.*_rank`) does around its own measurement, written
once so that the programs differ only in what they measure.

A rank program is started by ``dsnd bench`` on every rank of a gloo world over loopback
(`dsnd.commands.bench._ranks` passes the arguments of `parser`). `run` then does, in
this order: one thread and warnings-only logging, the world's size checked (`start`), the
runs resolved *before* the world starts (DeepSpeed's checks see the resolved runs, and a run
that does not resolve stops every rank before any of them waits on another), the process group,
the measurement, the process group's shutdown whatever happened, and rank 0's raw JSON.

The rest are the pieces the measurements share: the shipped ZeRO JSONs (`ds_json`), the run's
samples and a step's batches exactly as the trainer draws them (`sample_set`, `step_batches`), a
`StageRunner` built from the run's seed and destroyed after (`stage_runner`), every rank's
records in rank order (`gather`) and runs taking turns on the same steps (`take_turns`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dsnd.config.load import default_config_path
from dsnd.config.resolve import Resolved
from dsnd.data import SampleSet, batch_for_step, load_corpus
from dsnd.data.held_out import split_samples
from dsnd.distributed.groups import ProcessGroups
from dsnd.distributed.init import WorldInfo, init_world, shutdown, world_info
from dsnd.pipeline.executor import Batches
from dsnd.pipeline.runner import StageRunner

Runs = TypeVar("Runs")
Arg = TypeVar("Arg")


def ds_json(stage: int) -> str:
    """The shipped DeepSpeed JSON of ZeRO stage `stage` (``ds_configs/zero<stage>.json``)."""
    return os.path.join(os.path.dirname(default_config_path()), f"zero{stage}.json")


def parser(module: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The arguments every bench rank program takes (the launcher passes them)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    return parser


def start(what: str, world: int) -> WorldInfo:
    """One thread, warnings only, each line marked with the rank; this rank's world, which must
    have the `world` ranks `what` (a bench or one of its phases) runs on."""
    torch.set_num_threads(1)
    info = world_info(dict(os.environ))
    logging.basicConfig(level=logging.WARNING, format=f"[r{info.rank}] %(levelname)s %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if info.world_size != world:
        raise SystemExit(f"{what} runs on {world} ranks, got {info.world_size}")
    return info


def write_raw(path: str, raw: dict[str, Any]) -> None:
    """The raw measurements rank 0 hands to the bench command."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f)


def run(
    out: str,
    what: str,
    world: int,
    resolve_runs: Callable[[], Runs],
    measure: Callable[[Runs], dict[str, Any] | None],
    timeout_s: int = 300,
) -> None:
    """One rank of `what` on `world` ranks: `resolve_runs` before the world starts, `measure` on
    them inside it (the raw JSON, or None), the world shut down even when `measure` fails, and
    rank 0's raw JSON written to `out`."""
    info = start(what, world)
    runs = resolve_runs()
    init_world(info, timeout_s=timeout_s, backend="gloo")  # CPU ranks: never NCCL
    try:
        raw = measure(runs)
    finally:
        shutdown()
    if info.rank == 0 and raw is not None:
        write_raw(out, raw)


def sample_set(res: Resolved) -> SampleSet:
    """The run's training samples (its corpus cut into samples of its sequence length, the
    held-out ones excepted), as the trainer reads them."""
    data = res.run.data
    corpus = load_corpus(data.path, data.format, data.text_field, data.max_bytes)
    return split_samples(res.run, corpus).train


def step_batches(res: Resolved, samples: SampleSet, groups: ProcessGroups, step: int) -> Batches:
    """This rank's micro-batches of optimizer step `step`, as the trainer draws them."""
    b = res.batch
    return batch_for_step(
        samples, res.run.train.seed, step, b.train, groups.coord.dp, res.topology.dp, b.micro
    )


@contextmanager
def stage_runner(res: Resolved, groups: ProcessGroups) -> Iterator[StageRunner]:
    """This rank's `StageRunner` of `res` from the run's seed (without Hugging Face weights);
    its engine destroyed and its memory collected after, so that the next run starts clean."""
    torch.manual_seed(res.run.train.seed)
    runner = StageRunner(res, groups, load_hf=False)
    try:
        yield runner
    finally:
        runner.engine.destroy()
        del runner
        gc.collect()


def gather(mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order, on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def take_turns(
    names: Sequence[str],
    steps: int,
    warmup: int,
    prepare: Callable[[int], Arg],
    run: Callable[[str, Arg], dict[str, Any]],
) -> list[dict[str, Any]]:
    """`warmup` untimed then `steps` timed repetitions of the runs `names`: repetition r gives
    each run ``prepare(r)`` (step r's batches, made once), starting from run r mod k, so that
    none always goes first (with two runs: alternating order). One record per repetition, each
    run's ``run(name, prepare(r))`` under ``runs``."""
    names = list(names)
    records = []
    for rep in range(warmup + steps):
        arg = prepare(rep)
        order = names[rep % len(names) :] + names[: rep % len(names)]
        records.append(
            {
                "rep": rep,
                "timed": rep >= warmup,
                "order": order,
                "runs": {name: run(name, arg) for name in order},
            }
        )
    return records
