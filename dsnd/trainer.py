"""The training loop: an orchestrator over data, model, engine and metrics, not an engine itself.

Every layout runs the same way: this rank builds its pipeline stage (all layers when pp = 1) in
one DeepSpeed engine sharded over its data-parallel group, and each optimizer step runs the
stage's schedule (1F1B or GPipe over `gas` micro-batches) through `pipeline.executor`. The loss
is the mean over every micro-batch of every data-parallel rank, i.e. over the global batch, which
no parallel layout changes; the last stage computes it and every rank reports it.
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

from dsnd.compat import scope_zero3_trace_checks
from dsnd.config.resolve import Resolved
from dsnd.data import SampleSet, batch_for_step, load_corpus
from dsnd.dist.groups import ProcessGroups
from dsnd.metrics import MetricsWriter
from dsnd.model import layer_specs
from dsnd.pipeline.executor import StageShape, run_stage_step
from dsnd.pipeline.p2p import StageLinks
from dsnd.pipeline.schedule import schedule
from dsnd.pipeline.stage import build_stage, stage_parts
from dsnd.pipeline.tied import TiedWeights
from dsnd.zero import build_engine, zero_stage

log = logging.getLogger(__name__)


def save_resolved_configs(res: Resolved, log_dir: str) -> None:
    """The run's resolved YAML and DeepSpeed JSON, so any run can be reproduced from log.dir."""
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(dataclasses.asdict(res.run), f, sort_keys=False)
    with open(os.path.join(log_dir, "deepspeed.json"), "w", encoding="utf-8") as f:
        json.dump(res.ds, f, indent=2)


def _mean_over(group: dist.ProcessGroup, value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone().double()
    dist.all_reduce(value, group=group)
    return value / dist.get_world_size(group)


def _from_last_stage(groups: ProcessGroups, value: torch.Tensor | None, device) -> float:
    """The last stage's value, on every rank of the pipeline."""
    buf = value if value is not None else torch.zeros((), dtype=torch.float64, device=device)
    last = dist.get_process_group_ranks(groups.pipe)[-1]
    dist.broadcast(buf, src=last, group=groups.pipe)
    return buf.item()


def train(res: Resolved, groups: ProcessGroups) -> list[dict[str, Any]]:
    """Run `train.steps` optimizer steps; returns the metric rows (identical on every rank)."""
    run = res.run
    torch.manual_seed(run.train.seed)
    corpus = load_corpus(run.data.path, run.data.format, run.data.text_field, run.data.max_bytes)
    samples = SampleSet(corpus.tokens, run.model.seq_len, name=corpus.name)
    if res.topology.pp > 1:
        scope_zero3_trace_checks(groups.data)
    stack = build_stage(res, groups)
    tied = TiedWeights(stack, layer_specs(res.dims), stage_parts(res), groups)
    engine = build_engine(stack, res.ds, groups)
    actions = schedule(run.parallel.schedule, res.topology.pp, groups.coord.pp, res.batch.gas)
    links = StageLinks(groups, engine.device)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    shape = StageShape(res.batch.micro, run.model.seq_len, res.dims.hidden_size, dtype)
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
            result = run_stage_step(engine, actions, micro, links, shape, groups.model, tied)
            if result.loss is not None:
                result.loss = _mean_over(groups.data, result.loss.to(engine.device))
            loss = _from_last_stage(groups, result.loss, engine.device)
            elapsed = time.perf_counter() - start
            norm = result.grad_norm
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
