"""The training loop: an orchestrator over data, model, engine and metrics, not an engine itself.

One optimizer step = `gas` micro-batches per data-parallel rank, each forward/backward through
DeepSpeed (which accumulates, reduces over the data-parallel group and steps the optimizer at the
boundary). The reported loss is the mean over all micro-batches of all data-parallel ranks, i.e.
the mean over the global batch, which no parallel layout changes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import yaml

from dsnd.config.resolve import Resolved
from dsnd.data import SampleSet, batch_for_step, load_corpus
from dsnd.dist.groups import ProcessGroups
from dsnd.metrics import MetricsWriter
from dsnd.model import build_model, lm_loss
from dsnd.zero import build_engine, local_grad_norm, zero_stage

log = logging.getLogger(__name__)


def save_resolved_configs(res: Resolved, log_dir: str) -> None:
    """The run's resolved YAML and DeepSpeed JSON, so any run can be reproduced from log.dir."""
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(dataclasses.asdict(res.run), f, sort_keys=False)
    with open(os.path.join(log_dir, "deepspeed.json"), "w", encoding="utf-8") as f:
        json.dump(res.ds, f, indent=2)


def _mean_over(group: dist.ProcessGroup, value: torch.Tensor) -> float:
    value = value.detach().clone().double()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def train_step(
    engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, float | None]:
    """Forward/backward every micro-batch; the optimizer steps at the last one.

    Returns this rank's mean loss and, for ZeRO-0, the pre-clipping gradient norm.
    """
    device = engine.device
    total = torch.zeros((), dtype=torch.float64)
    norm = None
    for i, (x, y) in enumerate(micro_batches):
        loss = lm_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        if i == len(micro_batches) - 1 and zero_stage(engine) == 0:
            norm = local_grad_norm(engine)
        engine.step()
        total += loss.detach().double().cpu()
    return total / len(micro_batches), norm


def train(res: Resolved, groups: ProcessGroups) -> list[dict[str, Any]]:
    """Run `train.steps` optimizer steps; returns the metric rows (identical on every rank)."""
    run = res.run
    torch.manual_seed(run.train.seed)
    corpus = load_corpus(run.data.path, run.data.format, run.data.text_field, run.data.max_bytes)
    samples = SampleSet(corpus.tokens, run.model.seq_len, name=corpus.name)
    model = build_model(res.dims, run.train.seed)
    engine = build_engine(model, res.ds, groups)
    is_writer = dist.get_rank() == 0
    writer = MetricsWriter(run.log.dir) if is_writer else None
    if is_writer:
        save_resolved_configs(res, run.log.dir)
        log.info(
            "training %s on %s (%d samples), layout pp=%d dp=%d tp=%d, ZeRO-%d, batch %s",
            run.model.preset, corpus.name, len(samples), res.topology.pp, res.topology.dp,
            res.topology.tp, zero_stage(engine), res.batch,
        )  # fmt: skip
    rows = []
    try:
        for step in range(run.train.steps):
            lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step will use
            start = time.perf_counter()
            micro = batch_for_step(
                samples, run.train.seed, step, res.batch.train, groups.coord.dp,
                res.topology.dp, res.batch.micro,
            )  # fmt: skip
            local_loss, norm = train_step(engine, micro)
            loss = _mean_over(groups.data, local_loss)
            elapsed = time.perf_counter() - start
            if norm is None:
                norm = engine.get_global_grad_norm()
            row = {
                "step": step + 1,
                "loss": loss,
                "lr": lr,
                "grad_norm": float(norm) if norm is not None else None,
                "tokens_per_s": res.tokens_per_step / elapsed,
                "step_time_s": elapsed,
            }
            rows.append(row)
            if writer:
                writer.write(row)
                if (step + 1) % max(run.log.every, 1) == 0 or step + 1 == run.train.steps:
                    log.info(
                        "step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f",
                        step + 1, run.train.steps, loss, lr, row["grad_norm"] or 0.0,
                        row["tokens_per_s"],
                    )  # fmt: skip
    finally:
        if writer:
            writer.close()
        engine.destroy()
    return rows
