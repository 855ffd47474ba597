"""Rank program for multi-process tests: train several configs in one set of ranks.

Usage (every rank): python tests/distributed/train_cases.py OUT.json CASES.json
CASES.json: [{"name": ..., "config": path-or-null, "sets": [...], "reference": bool}]
Rank 0 writes {name: metric rows}. Starting ranks costs seconds, so cases share one world.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dsnd.checkpoint.resume import choose_resume  # noqa: E402
from dsnd.config.load import load  # noqa: E402
from dsnd.config.resolve import resolve  # noqa: E402
from dsnd.distributed.groups import run_groups  # noqa: E402
from dsnd.trainer import train  # noqa: E402
from tests.distributed.worker import this_rank, world, write_json  # noqa: E402


def main(out_path: str, cases_path: str) -> None:
    info = this_rank()
    with open(cases_path) as f:
        cases = json.load(f)
    resolved = [resolve(load(c.get("config"), c["sets"]), info.world_size) for c in cases]
    results = {}
    with world(info, timeout_s=120):
        for case, res in zip(cases, resolved, strict=True):
            if case.get("reference"):
                from tests.reference import reference_rows

                results[case["name"]] = reference_rows(res)
            else:  # checkpoint.resume decides, as in `dsnd train` (auto: the newest valid one)
                resume = choose_resume(res.run)
                results[case["name"]] = train(res, run_groups(res), resume)
    write_json(out_path, results, info.rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
