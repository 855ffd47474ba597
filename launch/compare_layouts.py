"""Train the same model on the same samples four ways and compare them side by side.

    python launch/compare_layouts.py [--steps 30] [--out runs/study]

1. one process (pp=1, dp=1, ZeRO-0)            dsnd train
2. data parallel, 2 ranks, ZeRO-0               dsnd launch --nprocs 2
3. fully sharded, 2 ranks, ZeRO-3               dsnd launch --nprocs 2
4. pipeline x ZeRO-3, 4 ranks (pp=2 x dp=2)     dsnd launch --nprocs 4

Same global batch (16) everywhere, so the losses agree to ~1e-6; what differs is memory per
rank (ZeRO-3 shards parameters, gradients and optimizer state; the pipeline splits the layers),
throughput and where the time goes. Prints a table and writes OUT/compare.png with `dsnd plot`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LAYOUTS = [
    ("1-single", ["train"], "zero0"),
    ("2-dp2-zero0", ["launch", "--nprocs", "2"], "zero0"),
    ("3-dp2-zero3", ["launch", "--nprocs", "2"], "zero3"),
    ("4-pp2-dp2-zero3", ["launch", "--nprocs", "4", "--set", "parallel.pp=2"], "zero3"),
]
HERE = os.path.dirname(os.path.abspath(__file__))


def run(name: str, command: list[str], zero: str, steps: int, out: str) -> list[dict]:
    log_dir = os.path.join(out, name)
    argv = [
        sys.executable,
        "-m",
        "dsnd",
        *command,
        "--set",
        f"train.steps={steps}",
        "--set",
        f"deepspeed={os.path.join(HERE, '..', 'ds_configs', zero + '.json')}",
        "--set",
        f"log.dir={log_dir}",
        "--set",
        "checkpoint.resume=never",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows[-steps:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/study")
    args = parser.parse_args()
    results = {name: run(name, cmd, zero, args.steps, args.out) for name, cmd, zero in LAYOUTS}
    print(
        f"{'layout':18} {'final loss':>10} {'tokens/s':>9} {'state MB/rank':>13} "
        f"{'grad-norm sd':>12} {'bubble':>6}"
    )
    for name, rows in results.items():
        later = rows[2:]  # past start-up
        print(
            f"{name:18} {rows[-1]['loss']:10.4f} "
            f"{statistics.median(r['tokens_per_s'] for r in later):9.0f} "
            f"{max(r['memory_live_bytes'] for r in rows) / 1e6:13.2f} "
            f"{statistics.pstdev(r['grad_norm'] for r in later):12.3f} "
            f"{statistics.median(r['pipeline_bubble'] for r in later):6.2f}"
        )
    png = os.path.join(args.out, "compare.png")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dsnd",
            "plot",
            *(os.path.join(args.out, n) for n, _, _ in LAYOUTS),
            "-o",
            png,
        ],
        check=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
