"""``dsnd plot LOG_DIR [LOG_DIR ...] -o out.png``: loss and throughput of runs side by side.

Each LOG_DIR is a run's `log.dir` (its metrics.jsonl); a curve is labelled with the directory's
name, so comparing layouts is one command. Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import json
import os

from dsnd.errors import UserError


def read_metrics(log_dir: str) -> list[dict]:
    path = os.path.join(log_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from e
    except ValueError as e:
        raise UserError(f"{path}: not JSON lines ({e})") from e
    if not rows:
        raise UserError(f"{path}: no steps recorded")
    # a resumed run appends: keep the last row of each step
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def plot_runs(log_dirs: list[str]):
    """A figure: loss per step (left) and tokens/s per step (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for log_dir in log_dirs:
        rows = read_metrics(log_dir)
        label = os.path.basename(os.path.normpath(log_dir))
        steps = [r["step"] for r in rows]
        loss_ax.plot(steps, [r["loss"] for r in rows], label=label)
        speed_ax.plot(steps, [r["tokens_per_s"] for r in rows], label=label)
    loss_ax.set(title="Training loss", xlabel="step", ylabel="loss (cross-entropy, nats)")
    speed_ax.set(title="Throughput", xlabel="step", ylabel="tokens / s")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def run_plot(log_dirs: list[str], out: str) -> int:
    fig = plot_runs(log_dirs)
    fig.savefig(out, dpi=120)
    print(f"wrote {out} ({len(log_dirs)} runs)")
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd plot LOG_DIR ... -o PNG``."""
    return run_plot(args.log_dirs, args.out)
