"""What a run writes as it goes (global rank 0): the resolved configs, one metrics row per step
(metrics.jsonl), TensorBoard scalars and the progress line. The trainer hands it each step's
numbers; nothing here talks to other ranks."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import yaml

from dsnd.config.ds_monitors import monitor_dir
from dsnd.config.resolve import Resolved
from dsnd.config.strict import as_data
from dsnd.model.moe_config import active_share
from dsnd.report.metrics import CsvWriter, MetricsWriter, TensorBoardWriter, WandbWriter
from dsnd.report.progress import Progress
from dsnd.secrets import mask_config
from dsnd.topology import Topology

log = logging.getLogger(__name__)

EXPERT_LOAD_STEPS = 5  # steps in a row over log.expert_load_warn before the warning


def save_resolved_configs(res: Resolved, log_dir: str) -> None:
    """config.yaml and deepspeed.json as the user gave them (--set applied, nothing derived), so
    ``dsnd train --config <log.dir>/config.yaml`` from the same directory reruns the same run;
    and deepspeed.resolved.json, the dict the engine got, for reading only (its batch keys are
    derived for this world and its learning rates already scaled by train.lr_scaling)."""
    os.makedirs(log_dir, exist_ok=True)
    run = dataclasses.replace(res.run, deepspeed="deepspeed.json")  # beside config.yaml
    with open(os.path.join(log_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(mask_config(as_data(run)), f, sort_keys=False)
    for name, ds in (("deepspeed.json", res.ds_user), ("deepspeed.resolved.json", res.ds)):
        with open(os.path.join(log_dir, name), "w", encoding="utf-8") as f:
            json.dump(mask_config(ds), f, indent=2)


def step_row(
    step: int,
    loss: float,
    lr: float,
    norm: float | None,
    elapsed: float,
    tokens: int,
    numbers: dict[str, Any],
) -> dict[str, Any]:
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


def layout_of(topology: Topology) -> dict[str, int]:
    """A run's parallel layout, as metrics.jsonl's "run_start" records it."""
    return {
        "pp": topology.pp,
        "dp": topology.dp,
        "tp": topology.tp,
        "cp": topology.cp,
        "ep": topology.ep,
        "world": topology.world_size,
    }


def saved_layout(manifest: dict) -> dict[str, int]:
    """The layout a checkpoint was saved on (its manifest; ep from its run config)."""
    topo = manifest["topology"]
    parallel = ((manifest.get("config") or {}).get("run") or {}).get("parallel") or {}
    return {
        "pp": topo["pp"],
        "dp": topo["dp"],
        "tp": topo["tp"],
        "cp": topo.get("cp", 1),
        "ep": parallel.get("ep", 1),
        "world": topo["world_size"],
    }


def layout_text(layout: dict[str, int]) -> str:
    """``pp=2 dp=1 tp=1 cp=1 ep=1`` (the degrees, world left out: their product)."""
    return " ".join(f"{k}={layout[k]}" for k in ("pp", "dp", "tp", "cp", "ep") if k in layout)


LAYOUT_WHY_ENV = "DSND_LAYOUT_WHY"
"""Why this start runs on the world and layout it does, as its launcher says it (an elastic
`dsnd launch`: a host lost or back); recorded in "run_start"."""


def start_mark(
    step: int,
    layout: dict[str, int],
    resumed_from: str | None = None,
    saved: dict[str, int] | None = None,
    why: str | None = None,
) -> dict[str, Any]:
    """metrics.jsonl's "run_start", on the first row a process writes: the step it started at,
    its layout, for a resume the checkpoint and the layout it was saved on, and why, where the
    launcher said (`LAYOUT_WHY_ENV`)."""
    mark = {"step": step, "layout": layout, "resumed_from": resumed_from, "saved_layout": saved}
    return {**mark, "why": why} if why else mark


def mark_label(mark: dict[str, Any]) -> str | None:
    """The short label of a resume or layout change (None for a fresh start): "resumed", or
    "resumed, layout pp 1->2 dp 2->1" naming the degrees that changed."""
    if not mark.get("resumed_from"):
        return None
    saved, now = mark.get("saved_layout") or {}, mark["layout"]
    changed = [
        f"{k} {saved[k]}->{now[k]}"
        for k in ("pp", "dp", "tp", "cp", "ep")
        if k in saved and saved[k] != now.get(k)
    ]
    return f"resumed, layout {' '.join(changed)}" if changed else "resumed"


def mark_text(mark: dict[str, Any]) -> str:
    """The TensorBoard text of a start: where, on which layout, from which checkpoint."""
    where = f"on {layout_text(mark['layout'])} (world {mark['layout']['world']})"
    if not mark.get("resumed_from"):
        return f"started at step {mark['step']} {where}"
    saved = mark.get("saved_layout")
    was = f", saved on {layout_text(saved)}" if saved else ""
    why = f" ({mark['why']})" if mark.get("why") else ""
    return (
        f"{mark_label(mark)}: at step {mark['step']} from {mark['resumed_from']} {where}{was}{why}"
    )


class ExpertLoadWatch:
    """Router collapse, seen in the expert-load tags (`telemetry.expert_load`) already
    reported every step: an alert when the busiest expert of some MoE layer stays over
    `threshold` times the mean for `EXPERT_LOAD_STEPS` steps in a row (once per such run of
    steps; the count restarts when every layer is back under it).

    An expert gets at most every token once, `ceiling` = experts / top-k times the mean (2.0
    for 4 experts, top-2): where that is not well above `threshold`, the limit is 90% of it, so
    that a collapse is still seen (mixtral-tiny without a load-balancing loss, observed outside
    the suite: its busiest expert at 1.97-2.0x the mean from the 4th step on; the mixtral-tiny
    test of `tests/unit/test_watch.py` replays such loads)."""

    SUFFIX = "_load_max_over_mean"

    def __init__(self, threshold: float, ceiling: float | None = None) -> None:
        self.threshold, self.streak = threshold, 0
        self.limit = min(threshold, 0.9 * ceiling) if ceiling else threshold

    def update(self, numbers: dict[str, Any]) -> dict[str, Any] | None:
        """The step's alert ({"layer", "max_over_mean", "steps"}) or None."""
        loads = {
            int(k[len("moe/layer") : -len(self.SUFFIX)]): v
            for k, v in numbers.items()
            if k.startswith("moe/layer") and k.endswith(self.SUFFIX)
        }
        if not self.threshold or not loads:
            return None
        layer, worst = max(loads.items(), key=lambda item: item[1])
        self.streak = self.streak + 1 if worst > self.limit else 0
        if self.streak != EXPERT_LOAD_STEPS:
            return None
        capped = (
            ""
            if self.limit == self.threshold
            else (f", capped at {self.limit:.2f}x: 90% of the most an expert can get here")
        )
        log.warning(
            "expert load: MoE layer %d's busiest expert got %.2fx the mean tokens, over "
            "log.expert_load_warn %s%s, for %d steps in a row: the router is collapsing "
            "onto few experts (the load-balancing loss, output_router_logits and "
            "router_aux_loss_coef, counters it)",
            layer,
            worst,
            self.threshold,
            capped,
            self.streak,
        )
        return {"layer": layer, "max_over_mean": worst, "steps": self.streak}


class Reporter:
    """Rank 0's outputs for one run (resolved configs written now)."""

    def __init__(self, res: Resolved) -> None:
        run = res.run
        save_resolved_configs(res, run.log.dir)
        self.metrics = MetricsWriter(run.log.dir)
        text = yaml.safe_dump(mask_config(as_data(run)), sort_keys=False)
        self.boards: list = []  # TensorBoard (log.dir; DeepSpeed's section) and CSV writers
        self.places: list[str] = []  # where they write, for the closing line
        if run.log.tensorboard:
            self.boards.append(TensorBoardWriter(run.log.dir, text))
            self.places.append(f"TensorBoard {run.log.dir}")
        monitors = res.monitors  # DeepSpeed's monitor sections, enabled
        if "tensorboard" in monitors:
            self.boards.append(TensorBoardWriter(monitor_dir(monitors["tensorboard"]), text))
            self.places.append(f"TensorBoard {monitor_dir(monitors['tensorboard'])}")
        if "csv_monitor" in monitors:
            self.boards.append(CsvWriter(monitor_dir(monitors["csv_monitor"])))
            self.places.append(f"csv {monitor_dir(monitors['csv_monitor'])}")
        if "wandb" in monitors:
            config = mask_config({"run": as_data(run), "deepspeed": res.ds})
            self.boards.append(WandbWriter(monitors["wandb"], run.log.dir, config))
            self.places.append(f"wandb {os.path.join(run.log.dir, 'wandb')}")
        self.progress = Progress(run.train.steps, run.log.every)
        ceiling = 1 / active_share(res.model.config) if res.model.family.moe else None
        self.load_watch = ExpertLoadWatch(run.log.expert_load_warn, ceiling)
        self.log_dir = run.log.dir

    def _marks(self, row: dict[str, Any], numbers: dict[str, Any]) -> dict[str, Any]:
        """`row` with this step's expert-load alert added; a start's or an alert's TensorBoard
        text and `events/` scalar (resume and layout change at the step resumed from)."""
        mark = row.get("run_start")
        if mark is not None:
            label = mark_label(mark)
            for board in self.boards:
                board.note(mark["step"], mark_text(mark))
                if label:
                    board.write(
                        mark["step"],
                        {
                            "events/resume": 1.0,
                            "events/layout_change": 1.0 if "layout" in label else None,
                        },
                    )
        alert = self.load_watch.update(numbers)
        if alert is None:
            return row
        for board in self.boards:
            board.note(
                row["step"],
                f"expert load: MoE layer {alert['layer']}'s busiest expert "
                f"{alert['max_over_mean']:.2f}x the mean for "
                f"{alert['steps']} steps",
            )
        numbers["events/expert_load"] = alert["max_over_mean"]
        return {**row, "moe_load_alert": alert}

    def write(self, row: dict[str, Any], numbers: dict[str, Any]) -> None:
        row = self._marks(row, numbers)
        self.metrics.write(row)
        scalars = {
            "train/loss": row["loss"],
            "train/lr": row["lr"],
            "train/grad_norm": row["grad_norm"],
            **numbers,
            "eval/loss": row.get("eval_loss"),
            "eval/perplexity": row.get("eval_perplexity"),
            "train/loss_scale": row.get("loss_scale"),
            "train/skipped_steps": row.get("skipped_steps"),
        }
        for board in self.boards:
            board.write(row["step"], scalars)
        self.progress.update(row)

    def closing_line(self, saved: str | None, root: str, export: str | None) -> str:
        """Where everything the run wrote is: metrics, the last checkpoint it saved (or the
        checkpoint root when it saved none), the monitors' directories, every rank's log and
        the export."""
        checkpoint = f"checkpoint {saved}" if saved else f"checkpoints {root} (none saved)"
        places = [
            f"metrics {self.metrics.path}",
            checkpoint,
            *self.places,
            f"logs {os.path.join(self.log_dir, 'logs')}",
        ]
        return "outputs: " + ", ".join(places + ([f"export {export}"] if export else []))

    def close(self) -> None:
        self.metrics.close()
        for board in self.boards:
            board.close()
