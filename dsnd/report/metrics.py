"""Run metrics as JSON lines: one object per step, flushed at once, appended on restart."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class TensorBoardWriter:
    """Scalars (``section/name``) and the resolved config as TensorBoard event files in
    `log_dir`, written by global rank 0 (torch's SummaryWriter over the tensorboard package)."""

    def __init__(self, log_dir: str, config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir)
        self._writer.add_text("config", "```yaml\n" + config_text + "\n```", 0)

    def write(self, step: int, scalars: dict[str, float | None]) -> None:
        for name, value in scalars.items():
            if value is not None and math.isfinite(value):
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def note(self, step: int, text: str) -> None:
        """A marked event (a resume, a layout change, an expert-load alert) as text at `step`."""
        self._writer.add_text("events", text, step)

    def close(self) -> None:
        self._writer.close()


class CsvWriter:
    """Scalars as DeepSpeed's csv_monitor writes them: one ``<name>.csv`` per scalar in
    `out_dir` ('/' in the name as '_'), rows ``step,value`` under a header."""

    def __init__(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir

    def write(self, step: int, scalars: dict[str, float | None]) -> None:
        for name, value in scalars.items():
            if value is None or not math.isfinite(value):
                continue
            path = os.path.join(self.out_dir, name.replace("/", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", encoding="utf-8") as f:
                if new:
                    f.write(f"step,{name}\n")
                f.write(f"{step},{value!r}\n")

    def note(self, step: int, text: str) -> None:
        """Events are in their `events/` scalars; CSV has no text."""

    def close(self) -> None:
        pass


class WandbWriter:
    """Scalars to Weights & Biases, as DeepSpeed's wandb monitor sends them (`wandb.init` with the
    section's project, group and team as entity, then `wandb.log` per step), with dsnd's step
    numbers; run files under `log_dir`. wandb's own environment applies: ``WANDB_MODE=offline``
    writes the run to disk only (``wandb sync`` uploads it later)."""

    def __init__(self, section: dict[str, Any], log_dir: str, config: dict[str, Any]) -> None:
        import wandb  # the optional dependency; the config check refuses the section without it

        self._run = wandb.init(
            project=section.get("project", "deepspeed"),
            group=section.get("group"),
            entity=section.get("team"),
            dir=log_dir,
            config=config,
        )

    def write(self, step: int, scalars: dict[str, float | None]) -> None:
        clean = {k: v for k, v in scalars.items() if v is not None and math.isfinite(v)}
        self._run.log(clean, step=step)

    def note(self, step: int, text: str) -> None:
        """Events are in their `events/` scalars (wandb's steps only grow: no text back in
        time)."""

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() returns before wandb's service has written the run file (observed, not in
        # the suite: 7 bytes of it on return, all of it 3 s later); teardown waits for it, as at
        # interpreter exit
        wandb.teardown()


class MetricsWriter:
    """Appends rows to ``<log_dir>/metrics.jsonl`` (global rank 0 only)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
