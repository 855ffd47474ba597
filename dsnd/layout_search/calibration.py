"""The time model's efficiencies fitted to published runs (`dsnd.layout_search.dense_runs`), and
how far those runs fall from the fitted model (`dsnd.layout_search.hardware.FITTED`, `ACCURACY`).

A run's predicted step is its work by kind at the device's peaks (`timing.StepCost`), each kind
divided by its efficiency. Six numbers are fitted: the GEMM and the attention-core efficiency of
each GPU generation (Ampere: A100; Hopper: H100), and, shared, the bandwidth efficiency (memory
traffic, collectives, messages) and the share of the data-parallel communication hidden under
compute. The fit minimises the weighted mean of log(predicted ÷ published step time) squared,
each publication's table of a device weighing as much as any other (70 rows of one benchmark
table count as much as Meta's two), by Nelder-Mead over the numbers' logits (each in 0..1).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from dsnd.layout_search import dense_runs
from dsnd.layout_search.dense_runs import DenseRun
from dsnd.layout_search.hardware import DEVICES, GENERATIONS, Accuracy, Efficiency

GENS = ("ampere", "hopper")


def fitted_runs() -> list[DenseRun]:
    return [r for r in dense_runs.RUNS if r.fitted]


def _arrays(runs: list[DenseRun]) -> dict[str, np.ndarray]:
    """Each run's work at the peaks: per stage (matmul, attention, bandwidth) seconds of one
    micro-batch, the micro-batch repeat, the data-parallel and the remaining once-a-step
    seconds; its generation and log published seconds; its weight."""
    depth = max(len(dense_runs.cost(r).stages) for r in runs)
    stages = np.zeros((len(runs), depth, 3))
    for i, r in enumerate(runs):
        for s, parts in enumerate(dense_runs.cost(r).stages):
            stages[i, s] = (parts["matmul"], parts["attention"], parts["memory"] + parts["links"])
    tables = Counter((r.source, r.device) for r in runs)
    return {
        "stages": stages,
        "repeat": np.array([dense_runs.cost(r).repeat for r in runs]),
        "dp": np.array([dense_runs.cost(r).once["data_parallel"] for r in runs]),
        "rest": np.array([dense_runs.cost(r).once["memory"] for r in runs]),
        "gen": np.array([GENS.index(GENERATIONS[r.device]) for r in runs]),
        "published": np.log([dense_runs.published_s(r) for r in runs]),
        "weight": np.array([1 / tables[(r.source, r.device)] for r in runs]),
    }


def _seconds(a: dict[str, np.ndarray], eff: list[Efficiency]) -> np.ndarray:
    """`StepCost.seconds` for every run at once (`eff` indexed by generation)."""
    inv = np.array([[1 / e.matmul, 1 / e.attention, 1 / e.bandwidth] for e in eff])[a["gen"]]
    busiest = (a["stages"] * inv[:, None, :]).sum(axis=2).max(axis=1)
    overlap = np.array([e.overlap for e in eff])[a["gen"]]
    dp, rest = a["dp"] * inv[:, 2], a["rest"] * inv[:, 2]
    return np.maximum(a["repeat"] * busiest + (1 - overlap) * dp, dp) + rest


def _efficiencies(x: np.ndarray) -> list[Efficiency]:
    v = 1 / (1 + np.exp(-x))  # logits -> 0..1
    return [Efficiency(float(v[g]), float(v[2 + g]), float(v[4]), float(v[5])) for g in (0, 1)]


def _nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, iters: int = 3000, step: float = 0.5
) -> np.ndarray:
    """The textbook simplex (reflect 1, expand 2, contract 1/2, shrink 1/2), deterministic."""
    pts = [x0] + [x0 + step * np.eye(len(x0))[i] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        centre = np.mean(pts[:-1], axis=0)
        reflected = 2 * centre - pts[-1]
        fr = f(reflected)
        if fr < vals[0]:
            expanded = 3 * centre - 2 * pts[-1]
            fe = f(expanded)
            pts[-1], vals[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = reflected, fr
        else:
            inner = (centre + pts[-1]) / 2
            fi = f(inner)
            if fi < vals[-1]:
                pts[-1], vals[-1] = inner, fi
            else:
                pts = [(pts[0] + p) / 2 for p in pts]
                vals = [f(p) for p in pts]
    return pts[int(np.argmin(vals))]


def fit(runs: list[DenseRun] | None = None) -> dict[str, Efficiency]:
    """The efficiencies per generation that best predict the runs (see the module docstring)."""
    a = _arrays(runs if runs is not None else fitted_runs())

    def loss(x: np.ndarray) -> float:
        err = np.log(_seconds(a, _efficiencies(x))) - a["published"]
        return float((a["weight"] * err**2).sum() / a["weight"].sum())

    x = np.zeros(6)
    for _ in range(2):  # a restart from the first optimum settles the simplex
        x = _nelder_mead(loss, x)
    return dict(zip(GENS, _efficiencies(x), strict=True))


def ratios(runs: list[DenseRun] | None = None) -> list[tuple[DenseRun, float]]:
    """Each run's measured ÷ predicted MFU (= predicted ÷ published step time) at the
    efficiencies its device runs at (`DEVICES`)."""
    runs = runs if runs is not None else list(dense_runs.RUNS)
    return [(r, dense_runs.predicted_s(r) / dense_runs.published_s(r)) for r in runs]


def accuracy() -> dict[str, Accuracy]:
    """Per generation, the range and rms of measured ÷ predicted MFU over its fitted runs."""
    out = {}
    for gen in GENS:
        got = [x for r, x in ratios(fitted_runs()) if GENERATIONS[r.device] == gen]
        rms = math.sqrt(sum((x - 1) ** 2 for x in got) / len(got))
        device = next(name for name, g in GENERATIONS.items() if g == gen and name in DEVICES)
        out[gen] = Accuracy(device, min(got), max(got), rms, len(got))
    return out


def report() -> list[str]:
    """Every published run: its MFU as published and as predicted, measured ÷ predicted, and
    whether it was fitted (`python -m dsnd.layout_search.calibration` prints it)."""
    lines = ["measured/predicted  published MFU  predicted MFU  run"]
    for run, ratio in ratios():
        got = dense_runs.mfu(run, dense_runs.published_s(run))
        predicted = dense_runs.mfu(run, dense_runs.predicted_s(run))
        left = "" if run.fitted else f"  [not fitted: {run.note.removeprefix('not fitted: ')}]"
        lines.append(f"{ratio:18.3f}  {got:13.1%}  {predicted:13.1%}  {run.label()}{left}")
    return lines


if __name__ == "__main__":
    print("\n".join(report()))
