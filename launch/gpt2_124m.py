"""A real-size model on this machine: GPT-2 (124M) at seq 256, pp=2 x dp=2, ZeRO-3, a few steps.

    python launch/gpt2_124m.py [--steps 3] [--out runs/gpt2-124m]

Runs `dsnd launch --nprocs 4` with the shipped `gpt2` preset (published hyperparameters, dropout
0) and ds_configs/zero3.json (global batch 16 of 256 tokens, lr warm-up from 3e-4), then prints
each step's loss and, per pipeline stage, the model-state bytes each rank holds (measured from
DeepSpeed's own tensors) next to ZeRO's formula for fp32 Adam: 16 bytes per parameter (weight 4,
gradient 4, Adam's two moments 8) of the stage's parameters, divided over its dp ranks, and the
process's peak resident set. An example, not a test: CPU timings here are noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PP, DP, SEQ = 2, 2, 256


def stage_parameters() -> list[int]:
    """Full parameters of each stage (the 'parameters' partition dsnd uses by default)."""
    from dsnd.model.count import layer_table
    from dsnd.model.source import load_model
    from dsnd.model.stack import layer_specs
    from dsnd.plan.partition import partition, stage_layers

    model = load_model("gpt2", "preset")
    counts = {i: n for i, _, n in layer_table(model)}
    parts = partition("parameters", layer_specs(model), PP)
    return [sum(counts[i] for i in stage_layers(parts, s)) for s in range(PP)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="runs/gpt2-124m")
    args = parser.parse_args()
    sets = {
        "model.preset": "gpt2",
        "model.seq_len": SEQ,
        "parallel.pp": PP,
        "train.steps": args.steps,
        "log.dir": args.out,
        "checkpoint.resume": "never",
        "checkpoint.every": 0,
        "log.tensorboard": "false",
        "deepspeed": os.path.join(HERE, "..", "ds_configs", "zero3.json"),
    }
    argv = [sys.executable, "-m", "dsnd", "launch", "--nprocs", str(PP * DP)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][-args.steps :]
    losses = [r["loss"] for r in rows]
    print("step  loss")
    for r in rows:
        print(f"{r['step']:>4}  {r['loss']:.4f}")
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    print(f"loss finite and falling: {ok}")
    print("stage  parameters      formula/rank   measured/rank   peak RSS/rank")
    for stage, psi in enumerate(stage_parameters()):
        formula = 16 * psi / DP
        live = max(r[f"memory_stage{stage}_live_bytes"] for r in rows)
        peak = max(r[f"memory_stage{stage}_peak_bytes"] for r in rows)
        print(
            f"{stage:>5}  {psi:>12,}  {formula / 2**20:>10.1f} MiB  {live / 2**20:>10.1f} MiB"
            f"  {peak / 2**20:>10.1f} MiB"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
