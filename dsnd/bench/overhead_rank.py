"""Rank program of ``dsnd bench overhead``; run by one rank::

    python -m dsnd.bench.overhead_rank OUT.json --log-dir DIR [--steps N] [--warmup W]
                                                [--set KEY=VALUE ...]

dsnd at world 1 (pp=1, dp=1, ZeRO-0: the shipped zero0.json, the default tiny model and batch)
against a plain PyTorch loop on the same model, in one process, one thread:

- dsnd: the trainer's own step (`dsnd.trainer` ``_setup`` once, then ``_step`` per step: the
  step's batch, `StageRunner` over a DeepSpeed engine, the loss report and the per-step
  telemetry; what ``dsnd train`` runs but for writing metrics and checkpoints);
- plain (`PlainLoop`): the model built from the same seed (the same initial weights), the same
  batches (`batch_for_step`), torch.optim.AdamW with the JSON's parameters and weight-decay
  groups, the JSON's gradient clipping and learning-rate schedule (DeepSpeed's scheduler class,
  which only sets the torch optimizer's rate), accumulation over the same micro-batches.

Repetition r trains step r on both, in alternating order, each timed whole. Rank 0 writes the
raw numbers to OUT.json; `dsnd.bench.overhead_results` turns them into rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from dsnd.bench import rank
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.data import SampleSet, batch_for_step
from dsnd.distributed.groups import run_groups
from dsnd.engine.deepspeed_api import lr_schedules
from dsnd.model import build_model, lm_loss, param_groups
from dsnd.report.flops import flops_per_token
from dsnd.trainer import _setup, _step

OVERHEAD_WORLD = 1
SIDES = ("dsnd", "plain")


def overhead_config(log_dir: str, extra: Sequence[str] = ()) -> Resolved:
    sets = [f"deepspeed={rank.ds_json(0)}", f"log.dir={log_dir}", "parallel.pp=1", *extra]
    return resolve(load(None, sets), OVERHEAD_WORLD)


class PlainLoop:
    """The baseline: a plain PyTorch training step of the same model, data and optimizer
    (written here, not taken from dsnd: it is what dsnd is measured against)."""

    def __init__(self, res: Resolved, samples: SampleSet) -> None:
        run, ds = res.run, res.ds
        if ds["optimizer"]["type"].lower() not in ("adam", "adamw"):
            raise SystemExit(f"the plain loop runs AdamW, not {ds['optimizer']['type']}")
        self.res, self.samples = res, samples
        torch.manual_seed(run.train.seed)
        self.model = build_model(res.model, run.train.seed)
        params = dict(ds["optimizer"].get("params") or {})
        for key in ("torch_adam", "adam_w_mode", "fp32_optimizer_states"):  # DeepSpeed's keys
            params.pop(key, None)
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        self.optimizer = torch.optim.AdamW(param_groups(self.model), **params)
        self.scheduler = None
        if ds.get("scheduler"):
            scheduler = getattr(lr_schedules(), ds["scheduler"]["type"])
            self.scheduler = scheduler(self.optimizer, **ds["scheduler"]["params"])
        self.clip = ds.get("gradient_clipping", 0.0)

    def step(self, step: int) -> float:
        """Optimizer step `step` (0-based); the mean loss over its micro-batches."""
        run, batch = self.res.run, self.res.batch
        micro = batch_for_step(self.samples, run.train.seed, step, batch.train, 0, 1, batch.micro)
        total = 0.0
        for x, y in micro:
            loss = lm_loss(self.model(x), y)
            (loss / len(micro)).backward()
            total += loss.item()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        return total / len(micro)


def bench(res: Resolved, steps: int, warmup: int) -> list[dict[str, Any]]:
    groups = run_groups(res)
    stage = _setup(res, groups, None)
    flops = (flops_per_token(res.model, res.run.model.seq_len), None)  # no MFU: no peak FLOP/s
    plain = PlainLoop(res, stage.samples)

    def dsnd_step(step: int) -> float:
        row, _, _ = _step(res, groups, stage, step, flops, None)
        return row["loss"]

    sides = {"dsnd": dsnd_step, "plain": plain.step}

    def timed(side: str, step: int) -> dict[str, float]:
        start = time.perf_counter()
        loss = sides[side](step)
        return {"step_s": time.perf_counter() - start, "loss": loss}

    try:
        return rank.take_turns(SIDES, steps, warmup, lambda rep: rep, timed)
    finally:
        stage.runner.engine.destroy()


def overhead_raw(res: Resolved, records: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "layout": {
            "model": res.model.describe(),
            "batch": str(res.batch),
            "seq_len": res.run.model.seq_len,
            "tokens_per_step": res.tokens_per_step,
            "zero_stage": res.plan.zero_stage,
            "optimizer": res.ds["optimizer"]["type"],
        },
        "reps": records,
    }


def main(argv: list[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.overhead_rank", steps=40, warmup=5)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    rank.run(
        args.out,
        "dsnd bench overhead",
        OVERHEAD_WORLD,
        lambda: overhead_config(args.log_dir, args.sets),
        lambda res: overhead_raw(res, bench(res, args.steps, args.warmup)),
    )


if __name__ == "__main__":
    main()
