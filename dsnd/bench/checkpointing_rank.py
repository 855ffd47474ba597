"""Rank program of ``dsnd bench activation-checkpointing``; run by one rank::

    python -m dsnd.bench.checkpointing_rank OUT.json [--steps N] [--warmup W] [--set KEY=VALUE]

One model (`SHAPE`: llama-tiny widened to hidden 256, 4 blocks, on sequences of 512 tokens, so
that a block's intermediates outweigh the loss's per-token vocabulary of 256) in two
`StageRunner`s, what the trainer runs: ``parallel.activation_checkpoint_interval`` 0 (off) and
`INTERVAL` (on), built from the same seed (same weights). Repetition r trains step r's batch on
both, in alternating order: seconds per step (the runner's step and the loss report), the loss,
the forward and backward seconds (`StepResult.times`) and the peak bytes autograd saved for
backward (`StepResult.activation_peak_bytes`; the meter measures the first step). ZeRO-0, 4
samples per step in micro-batches of 2; ``--micro-batches`` is not used.

Rank 0 writes the raw numbers to OUT.json; `dsnd.bench.memory_results` turns them into rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from dsnd.bench import rank
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import run_groups
from dsnd.pipeline.runner import StageRunner

CHECKPOINTING_WORLD = 1
INTERVAL = 1  # every layer its own chunk: each block keeps only its input
SHAPE = (
    "model.preset=llama-tiny",
    "model.hidden_size=256",
    "model.num_layers=4",
    "model.ffn_size=688",
    "model.seq_len=512",
    "model.max_position_embeddings=512",
    "ds.train_batch_size=4",
    "ds.train_micro_batch_size_per_gpu=2",
    "ds.gradient_accumulation_steps=null",
)
SIDES = {"off": 0, "on": INTERVAL}


def checkpointing_configs(extra: Sequence[str] = ()) -> dict[str, Resolved]:
    base = [f"deepspeed={rank.ds_json(0)}", *SHAPE, *extra]
    return {
        side: resolve(
            load(None, [*base, f"parallel.activation_checkpoint_interval={k}"]), CHECKPOINTING_WORLD
        )
        for side, k in SIDES.items()
    }


def _step(runner: StageRunner, micro) -> dict[str, Any]:
    start = time.perf_counter()
    result = runner.run(micro)
    loss, _ = runner.report(result)
    return {
        "step_s": time.perf_counter() - start,
        "loss": loss,
        "forward_s": result.times["forward"],
        "backward_s": result.times["backward"],
        "activation_peak_bytes": result.activation_peak_bytes,
    }


def bench(runs: dict[str, Resolved], steps: int, warmup: int) -> list[dict[str, Any]]:
    first = runs["off"]
    groups = run_groups(*runs.values())
    samples = rank.sample_set(first)
    with ExitStack() as built:
        runners = {
            side: built.enter_context(rank.stage_runner(res, groups)) for side, res in runs.items()
        }
        return rank.take_turns(
            list(SIDES),
            steps,
            warmup,
            lambda rep: rank.step_batches(first, samples, groups, rep),
            lambda side, micro: _step(runners[side], micro),
        )


def checkpointing_raw(runs: dict[str, Resolved], records: list[dict[str, Any]]) -> dict[str, Any]:
    res = runs["on"]
    return {
        "layout": {
            "model": res.model.describe(),
            "batch": str(res.batch),
            "micro": res.batch.micro,
            "seq_len": res.run.model.seq_len,
            "hidden": res.model.hidden_size,
            "vocab": res.model.vocab_size,
            "layers": len(res.plan.stage_layers(0)),
            "interval": res.run.parallel.activation_checkpoint_interval,
        },
        "reps": records,
    }


def main(argv: list[str] | None = None) -> None:
    args = rank.parser("dsnd.bench.checkpointing_rank", steps=10, warmup=1).parse_args(argv)

    def measure(runs: dict[str, Resolved]) -> dict[str, Any]:
        return checkpointing_raw(runs, bench(runs, args.steps, args.warmup))

    rank.run(
        args.out,
        "dsnd bench activation-checkpointing",
        CHECKPOINTING_WORLD,
        lambda: checkpointing_configs(args.sets),
        measure,
    )


if __name__ == "__main__":
    main()
