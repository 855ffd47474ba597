"""What a run writes as it goes (global rank 0): the resolved configs, one metrics row per step
(metrics.jsonl), TensorBoard scalars and the progress line. The trainer hands it each step's
numbers; nothing here talks to other ranks."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import yaml

from dsnd.config.ds_monitors import monitor_dir
from dsnd.config.resolve import Resolved
from dsnd.metrics import CsvWriter, MetricsWriter, TensorBoardWriter, WandbWriter
from dsnd.progress import Progress
from dsnd.secrets import mask_config


def save_resolved_configs(res: Resolved, log_dir: str) -> None:
    """config.yaml and deepspeed.json as the user gave them (--set applied, nothing derived), so
    ``dsnd train --config <log.dir>/config.yaml`` from the same directory reruns the same run;
    and deepspeed.resolved.json, the dict the engine got, for reading only (its batch keys are
    derived for this world and its learning rates already scaled by train.lr_scaling)."""
    os.makedirs(log_dir, exist_ok=True)
    run = dataclasses.replace(res.run, deepspeed="deepspeed.json")  # beside config.yaml
    with open(os.path.join(log_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(mask_config(dataclasses.asdict(run)), f, sort_keys=False)
    for name, ds in (("deepspeed.json", res.ds_user), ("deepspeed.resolved.json", res.ds)):
        with open(os.path.join(log_dir, name), "w", encoding="utf-8") as f:
            json.dump(mask_config(ds), f, indent=2)


def step_row(step: int, loss: float, lr: float, norm: float | None, elapsed: float,
             tokens: int, numbers: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The metrics.jsonl row of one optimizer step (`numbers`: `telemetry.step_numbers`)."""
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": norm,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        "samples_per_s": numbers["perf/samples_per_s"],
        "mfu": numbers["perf/mfu"],
        "pipeline_bubble": numbers["pipeline/bubble_fraction"],
        # the largest rank's model-state bytes (CPU) or allocated bytes (CUDA)
        "memory_live_bytes": max(v for k, v in numbers.items() if k.endswith("_live_bytes")),
        # per stage, its largest rank: memory_stage<s>_live_bytes / _peak_bytes (CUDA: this
        # step's) / _activation_peak_bytes (activations saved for backward, the most at once in
        # a step) and, on CUDA only, _reserved_bytes (the caching allocator's hold)
        **{k.replace("/", "_"): v for k, v in numbers.items() if k.startswith("memory/")},
    }


class Reporter:
    """Rank 0's outputs for one run (resolved configs written now)."""

    def __init__(self, res: Resolved) -> None:
        run = res.run
        save_resolved_configs(res, run.log.dir)
        self.metrics = MetricsWriter(run.log.dir)
        text = yaml.safe_dump(mask_config(dataclasses.asdict(run)), sort_keys=False)
        self.boards: list = []  # TensorBoard (log.dir; DeepSpeed's section) and CSV writers
        if run.log.tensorboard:
            self.boards.append(TensorBoardWriter(run.log.dir, text))
        monitors = res.monitors  # DeepSpeed's monitor sections, enabled
        if "tensorboard" in monitors:
            self.boards.append(TensorBoardWriter(monitor_dir(monitors["tensorboard"]), text))
        if "csv_monitor" in monitors:
            self.boards.append(CsvWriter(monitor_dir(monitors["csv_monitor"])))
        if "wandb" in monitors:
            config = mask_config({"run": dataclasses.asdict(run), "deepspeed": res.ds})
            self.boards.append(WandbWriter(monitors["wandb"], run.log.dir, config))
        self.progress = Progress(run.train.steps, run.log.every)

    def write(self, row: dict[str, Any], numbers: dict[str, Any]) -> None:
        self.metrics.write(row)
        scalars = {
            "train/loss": row["loss"], "train/lr": row["lr"], "train/grad_norm": row["grad_norm"],
            **numbers,
            "eval/loss": row.get("eval_loss"), "eval/perplexity": row.get("eval_perplexity"),
            "train/loss_scale": row.get("loss_scale"),
            "train/skipped_steps": row.get("skipped_steps"),
        }  # fmt: skip
        for board in self.boards:
            board.write(row["step"], scalars)
        self.progress.update(row)

    def close(self) -> None:
        self.metrics.close()
        for board in self.boards:
            board.close()
