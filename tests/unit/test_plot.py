"""`dsnd plot`: two runs' metrics.jsonl (written by dsnd's MetricsWriter) -> one readable PNG."""

from __future__ import annotations

import math

from matplotlib import image

from dsnd import cli
from dsnd.commands.plot import plot_runs
from dsnd.report.metrics import MetricsWriter
from dsnd.report.progress import Progress
from dsnd.report.reporter import start_mark


def write_run(log_dir, scale: float, steps: int = 6, resumed_at: int | None = None) -> None:
    writer = MetricsWriter(str(log_dir))
    for step in range(1, steps + 1):
        writer.write(
            {
                "step": step,
                "loss": 5.6 * scale * math.exp(-0.05 * step),
                "tokens_per_s": 1000.0 * scale + step,
            }
        )
    if resumed_at is not None:  # a resumed run appends the steps again
        for step in range(resumed_at, steps + 1):
            writer.write({"step": step, "loss": 1.0, "tokens_per_s": 1.0})
    writer.close()


def test_two_runs_two_curves_per_panel_with_labelled_axes(tmp_path):
    write_run(tmp_path / "pp2-z3", 1.0)
    write_run(tmp_path / "dp2-z0", 0.9, resumed_at=5)
    fig = plot_runs([str(tmp_path / "pp2-z3"), str(tmp_path / "dp2-z0")])
    loss_ax, speed_ax, lr_ax, norm_ax = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["step"] * 4
    assert "loss" in loss_ax.get_ylabel() and "tokens" in speed_ax.get_ylabel()
    assert (lr_ax.get_title(), norm_ax.get_title()) == (
        "Learning rate",
        "Gradient norm (before clipping)",
    )
    for ax in (loss_ax, speed_ax):
        lines = [line for line in ax.get_lines() if line.get_gid() is None]
        assert [line.get_label() for line in lines] == ["pp2-z3", "dp2-z0"]
        assert [list(line.get_xdata()) for line in lines] == [list(range(1, 7))] * 2
    # rows written before lr and grad_norm were recorded: empty panels, no failure
    assert lr_ax.get_lines()[0].get_xdata().size == 0
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
        alert = {"layer": 1, "max_over_mean": 2.0, "steps": 5} if step == 2 else None
        writer.write(
            {
                "step": step,
                "loss": 5.0,
                "tokens_per_s": 10.0,
                "moe_load_alert": alert,
                "moe_tokens_per_expert": {"0": [4, 4, 4, 4], "1": [8, 4, 2, 2 * step]},
            }
        )
    writer.close()
    write_run(tmp_path / "dense", 1.0)
    fig = plot_runs([str(tmp_path / "moe"), str(tmp_path / "dense")])
    load_ax = fig.axes[2]
    assert "Expert load" in load_ax.get_title()
    line, alert_line = load_ax.get_lines()
    assert line.get_label() == "moe"
    assert list(line.get_ydata()) == [2.0, 8 * 4 / 18]  # layer 1: busiest 8 of 16, then of 18
    # the expert-load alert (log.expert_load_warn) is marked where it was raised
    assert (alert_line.get_gid(), list(alert_line.get_xdata())) == ("mark", [2, 2])
    assert [t.get_text() for t in load_ax.texts] == [" load 2.0x"]


def test_throughput_is_the_progress_lines_moving_average_each_step_faint(tmp_path):
    """Step times alternating 0.1 s and 3.2 s (5700 and 178 tokens/s): the panel draws what the
    progress line said at each step, not the spikes; each step's own figure stays, faint."""
    writer = MetricsWriter(str(tmp_path / "jumpy"))
    rows = []
    for step in range(1, 26):
        seconds = 0.1 if step % 2 else 3.2
        rows.append(
            {
                "step": step,
                "loss": 5.0,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 570 / seconds,
                "step_time_s": seconds,
            }
        )
        writer.write(rows[-1])
    writer.close()
    progress = Progress(total=25, every=1)
    said = [float(progress.line(r).split("tokens/s ")[1].split()[0]) for r in rows]
    speed_ax = plot_runs([str(tmp_path / "jumpy")]).axes[1]
    raw, smooth = speed_ax.get_lines()
    assert raw.get_gid() == "raw" and raw.get_alpha() < 0.5
    assert list(raw.get_ydata()) == [r["tokens_per_s"] for r in rows]
    assert [round(v) for v in smooth.get_ydata()] == said
    assert max(smooth.get_ydata()[9:]) < 400  # from the 10th step: 5700 tokens in 16.5 s
    assert speed_ax.get_ylim() == (0, 1.5 * max(smooth.get_ydata()[9:]))  # spikes run off it


def test_resumes_and_layout_changes_are_marked_on_every_panel(tmp_path):
    """A run started, resumed at step 3 on its layout, and at step 6 on another (metrics.jsonl's
    run_start): a labelled dashed line at 3 and at 6 on each panel; lr, gradient norm and the
    held-out loss drawn."""
    dp2 = {"pp": 1, "dp": 2, "tp": 1, "cp": 1, "ep": 1, "world": 2}
    pp2 = {**dp2, "pp": 2, "dp": 1}
    starts = {
        1: start_mark(0, dp2),
        4: start_mark(3, dp2, "ck/step_3", dp2),
        7: start_mark(6, pp2, "ck/step_6", dp2),
    }
    writer = MetricsWriter(str(tmp_path / "run"))
    for steps in (range(1, 6), range(4, 7), range(7, 9)):  # the second resume drops 5, 6
        for step in steps:
            row = {
                "step": step,
                "loss": 5.0 - 0.1 * step,
                "lr": 1e-4 * step,
                "grad_norm": 2.0,
                "tokens_per_s": 100.0,
                "step_time_s": 1.0,
            }
            if step in starts and step == steps[0]:
                row["run_start"] = starts[step]
            if step % 4 == 0:
                row |= {"eval_loss": 4.0}
            writer.write(row)
    writer.close()
    fig = plot_runs([str(tmp_path / "run")])
    for ax in fig.axes:
        marks = [line for line in ax.get_lines() if line.get_gid() == "mark"]
        assert [list(line.get_xdata()) for line in marks] == [[3, 3], [6, 6]], ax.get_title()
        assert [t.get_text() for t in ax.texts] == [" resumed", " resumed, layout pp 1->2 dp 2->1"]
    loss_ax, _, lr_ax, norm_ax = fig.axes
    assert list(lr_ax.get_lines()[0].get_ydata()) == [1e-4 * s for s in range(1, 9)]
    assert list(norm_ax.get_lines()[0].get_ydata()) == [2.0] * 8
    held = loss_ax.get_lines()[1]
    assert (held.get_label(), list(held.get_xdata())) == ("run (held out)", [4, 8])
