"""Run metrics as JSON lines: one object per step, flushed at once, appended on restart."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class MetricsWriter:
    """Appends rows to ``<log_dir>/metrics.jsonl`` (global rank 0 only)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}  # fmt: skip
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
