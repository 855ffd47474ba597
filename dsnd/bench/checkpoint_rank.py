"""Rank program of ``dsnd bench checkpoint``; run by one rank::

    python -m dsnd.bench.checkpoint_rank OUT.json --log-dir DIR [--steps N] [--warmup W]
                                                  [--set KEY=VALUE ...]

What a checkpoint save costs the training it interrupts, synchronous against
``checkpoint.async``: one model (`SHAPE`: llama-tiny widened to hidden 512, 6 blocks, so that
the fp32 weights and Adam's two moments are about 230 MB, on a batch of 2 sequences of 8 tokens,
so that a step, mostly the optimizer's, is short against a save: a synchronous save takes about 4
steps' time here) trained by the trainer's own step (`dsnd.trainer` ``_setup`` once, then
``_step``) and saved by the trainer's `Saver`. ZeRO-0, one thread; ``--micro-batches`` is not
used.

Each repetition (`--warmup` untimed, then `--steps` timed) runs, for each mode in alternating
order, `BASELINE_STEPS` steps without a save and then a save:

- sync: the step that saves, timed with its save (what training waits for);
- async: the step that starts the save, timed with the save's start, then every following step
  that begins while the writer is still at work, each timed whole.

Seconds come from the host clock after a `torch.cuda.synchronize` where the device is CUDA (the
clock alone would time launches). Rank 0 writes the raw numbers to OUT.json;
`dsnd.bench.checkpoint_results` turns them into rows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsnd.bench import rank
from dsnd.checkpoint.files import latest
from dsnd.checkpoint.resume import checkpoint_root
from dsnd.checkpoint.save import Saver
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import run_groups
from dsnd.report.flops import flops_per_token
from dsnd.trainer import _setup, _step

CHECKPOINT_WORLD = 1
MODES = ("sync", "async")
BASELINE_STEPS = 4  # steps without a save before each save
MAX_IN_FLIGHT = 200  # steps an asynchronous save may take before the bench gives up on it
SHAPE = (
    "model.preset=llama-tiny",
    "model.hidden_size=512",
    "model.num_layers=6",
    "model.num_heads=8",
    "model.num_kv_heads=8",
    "model.ffn_size=1376",
    "model.seq_len=8",
    "ds.train_batch_size=2",
    "ds.train_micro_batch_size_per_gpu=2",
    "ds.gradient_accumulation_steps=null",
    "checkpoint.at_end=false",
    "checkpoint.keep=1",
    "eval.fraction=0",
    "train.steps=100000",
)


def checkpoint_config(log_dir: str, extra: Sequence[str] = ()) -> Resolved:
    sets = [f"deepspeed={rank.ds_json(0)}", f"log.dir={log_dir}", *SHAPE, *extra]
    return resolve(load(None, sets), CHECKPOINT_WORLD)


def _clock(device: torch.device) -> Callable[[], float]:
    """The host clock once the device is done with what was issued (CUDA runs asynchronously)."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _saves(res: Resolved, groups, stage) -> dict[str, Saver]:
    """A synchronous and an asynchronous `Saver` of the same run."""
    out = {}
    for mode in MODES:
        ck = dataclasses.replace(res.run.checkpoint, async_=mode == "async")
        mine = dataclasses.replace(res, run=dataclasses.replace(res.run, checkpoint=ck))
        out[mode] = Saver(mine, groups, stage.root, stage.corpus, None)
    return out


def bench(res: Resolved, steps: int, warmup: int) -> list[dict[str, Any]]:
    groups = run_groups(res)
    stage = _setup(res, groups, None)
    engine = stage.runner.engine
    flops = (flops_per_token(res.model, res.run.model.seq_len), None)
    savers = _saves(res, groups, stage)
    now = _clock(engine.device)
    step = 0

    def timed(save: Callable[[], object] | None = None) -> float:
        nonlocal step
        start = now()
        _step(res, groups, stage, step, flops, None)
        step += 1
        if save is not None:
            save()
        return now() - start

    records = []
    try:
        for rep in range(warmup + steps):
            for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
                baseline = [timed() for _ in range(BASELINE_STEPS)]
                saver = savers[mode]
                during = [timed(lambda s=saver: s.save(engine, step))]
                while saver.writer is not None and saver.writer.in_flight:
                    if len(during) >= MAX_IN_FLIGHT:
                        break
                    during.append(timed())
                finish = now()
                saver.finish(engine)
                rec = {"rep": rep, "timed": rep >= warmup, "mode": mode, "baseline_s": baseline}
                records.append(rec | {"during_s": during, "join_s": now() - finish})
    finally:
        for saver in savers.values():
            saver.close()
        engine.destroy()
    return records


def _bytes(root: str) -> int:
    """The size of the newest checkpoint under `root`."""
    step_dir = latest(root)
    if step_dir is None:
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)


def checkpoint_raw(res: Resolved, records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "layout": {
            "model": res.model.describe(),
            "batch": str(res.batch),
            "seq_len": res.run.model.seq_len,
            "zero_stage": res.plan.zero_stage,
            "optimizer": res.ds["optimizer"]["type"],
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "checkpoint_bytes": _bytes(checkpoint_root(res.run)),
        },
        "reps": records,
    }


def main(argv: list[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.checkpoint_rank", steps=3, warmup=1)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    rank.run(
        args.out,
        "dsnd bench checkpoint",
        CHECKPOINT_WORLD,
        lambda: checkpoint_config(args.log_dir, args.sets),
        lambda res: checkpoint_raw(res, bench(res, args.steps, args.warmup)),
    )


if __name__ == "__main__":
    main()
