"""``dsnd plot LOG_DIR [LOG_DIR ...] -o out.png``: loss and throughput of runs side by side, and
the expert load of mixture-of-experts runs.

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


def worst_load(row: dict) -> float | None:
    """A mixture of experts' step: the busiest expert over the mean in its most unbalanced MoE
    layer (1: every layer perfectly balanced); None for a dense model."""
    load = row.get("moe_tokens_per_expert")
    if not load:
        return None
    return max(max(counts) * len(counts) / sum(counts) for counts in load.values())


def plot_runs(log_dirs: list[str]):
    """A figure: loss per step (left) and tokens/s per step (middle), one line per run; when a
    run is a mixture of experts, its expert load per step (right, `worst_load`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = [(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in log_dirs]
    moe = any(worst_load(rows[0]) is not None for _, rows in runs)
    fig, axes = plt.subplots(1, 3 if moe else 2, figsize=(16 if moe else 11, 4),
                             constrained_layout=True)  # fmt: skip
    loss_ax, speed_ax = axes[0], axes[1]
    for label, rows in runs:
        steps = [r["step"] for r in rows]
        loss_ax.plot(steps, [r["loss"] for r in rows], label=label)
        speed_ax.plot(steps, [r["tokens_per_s"] for r in rows], label=label)
        if moe and worst_load(rows[0]) is not None:
            axes[2].plot(steps, [worst_load(r) for r in rows], label=label)
    loss_ax.set(title="Training loss", xlabel="step", ylabel="loss (cross-entropy, nats)")
    speed_ax.set(title="Throughput", xlabel="step", ylabel="tokens / s")
    if moe:
        axes[2].set(title="Expert load (most unbalanced MoE layer)", xlabel="step",
                    ylabel="busiest expert's tokens / mean")  # fmt: skip
    for ax in axes:
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
