"""`dsnd plot`: two runs' metrics.jsonl (written by dsnd's MetricsWriter) -> one readable PNG."""

from __future__ import annotations

import math

from matplotlib import image

from dsnd import cli
from dsnd.commands.plot import plot_runs
from dsnd.metrics import MetricsWriter


def write_run(log_dir, scale: float, steps: int = 6, resumed_at: int | None = None) -> None:
    writer = MetricsWriter(str(log_dir))
    for step in range(1, steps + 1):
        writer.write({"step": step, "loss": 5.6 * scale * math.exp(-0.05 * step),
                      "tokens_per_s": 1000.0 * scale + step})  # fmt: skip
    if resumed_at is not None:  # a resumed run appends the steps again
        for step in range(resumed_at, steps + 1):
            writer.write({"step": step, "loss": 1.0, "tokens_per_s": 1.0})
    writer.close()


def test_two_runs_two_curves_per_panel_with_labelled_axes(tmp_path):
    write_run(tmp_path / "pp2-z3", 1.0)
    write_run(tmp_path / "dp2-z0", 0.9, resumed_at=5)
    fig = plot_runs([str(tmp_path / "pp2-z3"), str(tmp_path / "dp2-z0")])
    loss_ax, speed_ax = fig.axes
    assert (loss_ax.get_xlabel(), speed_ax.get_xlabel()) == ("step", "step")
    assert "loss" in loss_ax.get_ylabel() and "tokens" in speed_ax.get_ylabel()
    for ax in (loss_ax, speed_ax):
        assert [line.get_label() for line in ax.get_lines()] == ["pp2-z3", "dp2-z0"]
        assert [list(line.get_xdata()) for line in ax.get_lines()] == [list(range(1, 7))] * 2
    # the resumed run's re-recorded steps 5, 6 replace the first ones
    assert list(loss_ax.get_lines()[1].get_ydata())[-2:] == [1.0, 1.0]


def test_cli_writes_a_png(tmp_path, capsys):
    write_run(tmp_path / "a", 1.0)
    write_run(tmp_path / "b", 0.8)
    out = tmp_path / "cmp.png"
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(str(out))
    assert pixels.shape[0] > 400 and pixels.shape[1] > 1000
    assert "wrote" in capsys.readouterr().out


def test_missing_run_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsnd: error: ") and "metrics.jsonl: cannot read" in err
    assert not (tmp_path / "x.png").exists()


def test_moe_runs_get_an_expert_load_panel(tmp_path):
    """A mixture of experts' rows carry tokens per expert per MoE layer; the third panel draws
    the most unbalanced layer's busiest expert over the mean (a dense run draws none there)."""
    writer = MetricsWriter(str(tmp_path / "moe"))
    for step in (1, 2):
        writer.write({"step": step, "loss": 5.0, "tokens_per_s": 10.0,
                      "moe_tokens_per_expert": {"0": [4, 4, 4, 4], "1": [8, 4, 2, 2 * step]}})
    writer.close()
    write_run(tmp_path / "dense", 1.0)
    fig = plot_runs([str(tmp_path / "moe"), str(tmp_path / "dense")])
    load_ax = fig.axes[2]
    assert "Expert load" in load_ax.get_title()
    (line,) = load_ax.get_lines()
    assert line.get_label() == "moe"
    assert list(line.get_ydata()) == [2.0, 8 * 4 / 18]  # layer 1: busiest 8 of 16, then of 18
