"""Rank program of ``dsnd bench context``; run by every rank of a 4-rank gloo world::

    python -m dsnd.bench.context_rank OUT.json [--steps N] [--warmup W] [--seqs 2048,4096]
                                                [--set KEY=VALUE ...]

For each sequence length, five layouts of the same tiny-width model (`SHAPE`) on the same 4
ranks, one `StageRunner` (what the trainer runs) at a time: cp=1 x dp=4 (every rank holds whole
sequences: the baseline), ring and Ulysses at cp=2 x dp=2 and at cp=4 x dp=1. Every layout
trains the same 4 sequences per step, as micro-batches of one sequence (4/dp of them per rank,
each's backward done before the next forward), so a rank's activations at their peak are those
of one sequence, or of its 1/cp slice, and all layouts see the same samples (same losses).

Per layout: the bytes of activations the rank saved for backward at its peak (the executor's
`ActivationMeter`, which measures the first step: the warm-up), the largest over ranks; and
seconds per step (from a common barrier, median of the timed steps, slowest rank). Rank 0
writes the raw numbers to OUT.json; `dsnd.bench.context_results` turns them into rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsnd.bench import rank
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import run_groups
from dsnd.pipeline.runner import StageRunner

CONTEXT_WORLD = 4
SEQS = (2048, 4096, 8192)
LAYOUTS = {
    "cp1": (),
    "ring-cp2": ("parallel.cp=2", "parallel.cp_impl=ring"),
    "ulysses-cp2": ("parallel.cp=2", "parallel.cp_impl=ulysses"),
    "ring-cp4": ("parallel.cp=4", "parallel.cp_impl=ring"),
    "ulysses-cp4": ("parallel.cp=4", "parallel.cp_impl=ulysses"),
}
"""The layouts compared at each length, the baseline (whole sequences) first."""
SHAPE = ("model.preset=llama-tiny", "model.num_layers=2", "model.num_kv_heads=4")
"""llama-tiny's width (64, 4 heads) with 4 key/value heads, so Ulysses runs at cp=4."""


def context_sets(seq: int, layout: str, extra: Sequence[str] = ()) -> list[str]:
    """The run keys of one layout at length `seq`: ZeRO-1, micro-batches of one sequence, 4
    sequences per step."""
    return [
        f"deepspeed={rank.ds_json(1)}",
        *SHAPE,
        f"model.seq_len={seq}",
        f"model.max_position_embeddings={seq}",
        "ds.train_micro_batch_size_per_gpu=1",
        f"ds.train_batch_size={CONTEXT_WORLD}",
        "ds.gradient_accumulation_steps=null",
        *LAYOUTS[layout],
        *extra,
    ]


def _timed_step(runner: StageRunner, res: Resolved, samples, groups, step: int) -> tuple:
    """(slowest rank's seconds, activation peak bytes, loss) of optimizer step `step`."""
    micro = rank.step_batches(res, samples, groups, step)
    dist.barrier()
    start = time.perf_counter()
    result = runner.run(micro)
    device = runner.engine.device  # an NCCL group reduces device tensors only
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    peak = torch.tensor([result.activation_peak_bytes], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    loss, _ = runner.report(result)
    return seconds.item(), int(peak.item()), loss


def measure(res: Resolved, steps: int, warmup: int) -> dict[str, Any]:
    """One layout: its activation peak (first step) and step seconds (timed steps)."""
    groups = run_groups(res)
    samples = rank.sample_set(res)
    with rank.stage_runner(res, groups) as runner:
        seconds, peak, losses = [], None, []
        for step in range(warmup + steps):
            s, p, loss = _timed_step(runner, res, samples, groups, step)
            peak = p if peak is None else peak  # the meter measures the first step
            losses.append(loss)
            if step >= warmup:
                seconds.append(s)
        return {
            "activation_peak_bytes": peak,
            "step_s": statistics.median(seconds),
            "losses": losses,
        }


def context_configs(seqs: list[int], extra: Sequence[str] = ()) -> dict[tuple, Resolved]:
    """Every layout of `LAYOUTS` at every length of `seqs`, resolved."""
    return {
        (seq, name): resolve(load(None, context_sets(seq, name, extra)), CONTEXT_WORLD)
        for seq in seqs
        for name in LAYOUTS
    }


def main(argv: list[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.context_rank", steps=3, warmup=1)
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    args = parser.parse_args(argv)
    warmup = max(1, args.warmup)  # the measured step is the first; it is not timed
    seqs = [int(s) for s in args.seqs.split(",")]

    def measure_all(runs: dict[tuple, Resolved]) -> dict[str, Any]:
        raw: dict[str, Any] = {"seqs": seqs, "layouts": list(LAYOUTS), "runs": {}}
        for (seq, name), res in runs.items():
            raw["runs"][f"{seq}/{name}"] = measure(res, args.steps, warmup)
        return raw

    rank.run(
        args.out,
        "dsnd bench context",
        CONTEXT_WORLD,
        lambda: context_configs(seqs, args.sets),
        measure_all,
        timeout_s=600,
    )


if __name__ == "__main__":
    main()
