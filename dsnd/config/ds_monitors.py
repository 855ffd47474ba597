"""DeepSpeed's monitor sections (tensorboard, csv_monitor, wandb): checked, and written by dsnd
itself where DeepSpeed would write them."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from dsnd.errors import did_you_mean

MONITORS = {
    "tensorboard": {"enabled": bool, "output_path": str, "job_name": str},
    "csv_monitor": {"enabled": bool, "output_path": str, "job_name": str},
    "wandb": {"enabled": bool, "project": str, "group": str, "team": str},
}
"""DeepSpeed monitors (with their keys) dsnd writes itself, with its own step numbers, where
DeepSpeed would: tensorboard and csv_monitor into ``output_path/job_name``, wandb to its project
(DeepSpeed's monitors would count each stage engine's micro-batch calls as steps). They are
taken out of the dict DeepSpeed gets (`take_monitors`)."""


def check_monitor(key: str, value: Any, path: str, notes: list[str]) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: {key} must be an object, got {value!r}"]
    fields = MONITORS[key]
    problems = []
    for k, v in value.items():
        if k not in fields:
            problems.append(f"{path}: {key}: unknown key '{k}'" + did_you_mean(k, fields))
        elif not isinstance(v, fields[k]):
            problems.append(f"{path}: {key}.{k} must be {fields[k].__name__}, got {v!r}")
    if value.get("enabled") and key == "wandb" and importlib.util.find_spec("wandb") is None:
        problems.append(
            f"{path}: wandb.enabled needs the wandb package, which is not installed "
            "(pip install wandb)"
        )
    if not problems:
        notes.append(f"{key}: {_monitor_note(key, value)}")
    return problems


def _monitor_note(key: str, section: dict[str, Any]) -> str:
    if not section.get("enabled"):
        return "off"
    if key == "wandb":
        return (
            f"written by dsnd to project {section.get('project', 'deepspeed')!r} "
            "(WANDB_MODE=offline keeps the run on disk, under log.dir)"
        )
    return f"written by dsnd into {monitor_dir(section)}"


def monitor_dir(section: dict[str, Any]) -> str:
    """Where DeepSpeed's monitor of `section` writes: ``output_path/job_name``."""
    return os.path.join(section.get("output_path", ""), section.get("job_name", "DeepSpeedJobName"))


def take_monitors(ds: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Remove the monitor sections from `ds`; {monitor: its section} for the enabled ones."""
    sections = {key: ds.pop(key) for key in MONITORS if key in ds}
    return {key: s for key, s in sections.items() if s.get("enabled")}
