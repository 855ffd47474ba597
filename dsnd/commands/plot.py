"""``dsnd plot LOG_DIR [LOG_DIR ...] -o out.png``: loss, throughput, learning rate and gradient
norm of runs side by side, and the expert load of mixture-of-experts runs.

Each LOG_DIR is a run's `log.dir` (its metrics.jsonl); a curve is labelled with the directory's
name, so comparing layouts is one command. Throughput is drawn as the progress line showed it
(tokens/s over the last steps, `dsnd.report.progress.smoothed_rates`: one step's own figure swings
widely on a shared machine), each step's own figure faint behind it. Where a run resumed, and
where it resumed on another layout, a dashed vertical line in the run's colour marks every
panel (metrics.jsonl's "run_start"); an expert-load alert (`log.expert_load_warn`) marks the
expert-load panel. metrics.jsonl files written before these fields existed plot without them.
Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import json
import os

from dsnd.errors import UserError
from dsnd.report.progress import WINDOW, smoothed_rates
from dsnd.report.reporter import mark_label


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


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows that have a number under `key`."""
    kept = [r for r in rows if isinstance(r.get(key), (int, float))]
    return [r["step"] for r in kept], [r[key] for r in kept]


def _mark(ax, x: float, text: str, color: str) -> None:
    ax.axvline(x, color=color, linestyle="--", linewidth=0.8, alpha=0.7, gid="mark")
    ax.text(
        x,
        0.98,
        f" {text}",
        transform=ax.get_xaxis_transform(),
        rotation=90,
        va="top",
        ha="right",
        fontsize=7,
        color=color,
        clip_on=True,
    )


def _draw_run(panels: dict, label: str, rows: list[dict]) -> float:
    """Draw one run on every panel; the top its throughput axis needs: 1.5 x the averaged
    line past its first window (one step's spike runs off the axis; the faint line says so)."""
    steps = [r["step"] for r in rows]
    (line,) = panels["loss"].plot(steps, [r["loss"] for r in rows], label=label)
    color = line.get_color()
    held = _series(rows, "eval_loss")
    if held[0]:
        panels["loss"].plot(*held, "o--", color=color, markersize=3, label=f"{label} (held out)")
    speed = panels["speed"]
    speed.plot(
        steps,
        [r["tokens_per_s"] for r in rows],
        color=color,
        alpha=0.25,
        linewidth=0.8,
        label=f"_{label} per step",
        gid="raw",
    )
    smooth = smoothed_rates(rows)
    speed.plot(steps, smooth, color=color, label=label)
    for key in ("lr", "grad_norm"):
        panels[key].plot(*_series(rows, key), color=color, label=label)
    if "load" in panels and worst_load(rows[0]) is not None:
        panels["load"].plot(steps, [worst_load(r) for r in rows], color=color, label=label)
        for r in rows:
            alert = r.get("moe_load_alert")
            if alert:
                _mark(panels["load"], r["step"], f"load {alert['max_over_mean']:.1f}x", color)
    for r in rows:
        text = mark_label(r["run_start"]) if r.get("run_start") else None
        if text:
            for ax in panels.values():
                _mark(ax, r["run_start"]["step"], text, color)
    return 1.5 * max(smooth[WINDOW - 1 :] or smooth)


def plot_runs(log_dirs: list[str]):
    """A figure, one line per run: loss per step with the held-out loss where evaluated,
    tokens/s, learning rate, gradient norm and, when a run is a mixture of experts, its expert
    load per step (`worst_load`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = [(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in log_dirs]
    moe = any(worst_load(rows[0]) is not None for _, rows in runs)
    fig, grid = plt.subplots(
        2, 3 if moe else 2, figsize=(16 if moe else 11, 7.5), constrained_layout=True
    )
    axes = list(grid.flat)
    names = (
        ["loss", "speed", "load", "lr", "grad_norm"]
        if moe
        else ["loss", "speed", "lr", "grad_norm"]
    )
    if moe:
        fig.delaxes(axes.pop())
    panels = dict(zip(names, axes, strict=True))
    top = max(_draw_run(panels, label, rows) for label, rows in runs)
    panels["speed"].set_ylim(0, top)
    panels["loss"].set(
        title="Training loss (dots: held out)", xlabel="step", ylabel="loss (cross-entropy, nats)"
    )
    panels["speed"].set(
        title=f"Throughput (over the last {WINDOW} steps; faint: each step)",
        xlabel="step",
        ylabel="tokens / s",
    )
    panels["lr"].set(title="Learning rate", xlabel="step", ylabel="lr")
    panels["grad_norm"].set(
        title="Gradient norm (before clipping)", xlabel="step", ylabel="global L2 norm"
    )
    if moe:
        panels["load"].set(
            title="Expert load (most unbalanced MoE layer)",
            xlabel="step",
            ylabel="busiest expert's tokens / mean",
        )
    for ax in panels.values():
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an older metrics.jsonl may have no lr, say
            ax.legend(fontsize=8)
    return fig


def run_plot(log_dirs: list[str], out: str) -> int:
    fig = plot_runs(log_dirs)
    fig.savefig(out, dpi=120)
    print(f"wrote {out} ({len(log_dirs)} runs)")
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd plot LOG_DIR ... -o PNG``."""
    return run_plot(args.log_dirs, args.out)
