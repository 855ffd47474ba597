"""The measuring functions of ``dsnd bench zero-comm | tp-comm`` (registered in
`dsnd.commands.bench.BENCHES`): each runs the phases of `dsnd.bench.comm_rank` it needs and turns
rank 0's raw JSON into rows (`dsnd.bench.comm_results`).

- zero-comm: phase ``zero`` on 2 ranks (pp=1 x dp=2), then ``zero-pp`` on 4 (pp=2 x dp=2);
- tp-comm: phase ``tp`` on 2 ranks (tp=2).

Each run sets its own micro-batches per step (--micro-batches is not used); --steps counts steps
(their counts are the same each step) and --warmup the uncounted steps before them.
"""

from __future__ import annotations

import argparse
import os

from dsnd.commands.bench import _ranks

RANK_MODULE = "dsnd.bench.comm_rank"


def _phase(name: str, args: argparse.Namespace, tmp: str) -> dict:
    from dsnd.bench.comm_results import WORLDS

    extra = ["--phase", name, *(f"--set={item}" for item in args.sets)]
    return _ranks(
        RANK_MODULE,
        WORLDS[name],
        os.path.join(tmp, f"{name}.json"),
        args.steps,
        args.warmup,
        args.micro_batches,
        extra,
    )


def zero_comm(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.comm_results import zero_rows

    return zero_rows({name: _phase(name, args, tmp) for name in ("zero", "zero-pp")})


def tp_comm(args: argparse.Namespace, tmp: str) -> list:
    from dsnd.bench.comm_results import tp_rows

    return tp_rows(_phase("tp", args, tmp))
