"""Rank 0's progress line: live on a terminal (rewritten in place), plain log lines elsewhere."""

from __future__ import annotations

import io
import json
import logging

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.report.progress import Progress, rank_prefix
from dsnd.report.reporter import Reporter
from dsnd.topology import Topology


def row(step: int, step_time: float = 2.0) -> dict:
    return {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 1.5,
        "tokens_per_s": 1234.4,
        "step_time_s": step_time,
    }


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_line_on_a_terminal_with_eta():
    out = Terminal()
    progress = Progress(total=4, every=1, stream=out)
    for step in range(1, 5):
        progress.update(row(step))
    text = out.getvalue()
    assert text.count("\r\033[K") == 4 and text.endswith("\n") and text.count("\n") == 1
    first = text.split("\r\033[K")[1]
    assert first == "step 1/4 loss 4.9000 lr 1.00e-03 grad_norm 1.500 tokens/s 1234 ETA 0:00:06"


def test_plain_lines_every_n_steps_off_a_terminal_and_eta_after_resume(caplog):
    progress = Progress(total=15, every=2, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="dsnd.report.progress"):
        for step in range(11, 16):
            progress.update(row(step, step_time=60.0))
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[1] for line in lines] == ["12/15", "14/15", "15/15"]
    assert lines[0].endswith("ETA 0:03:00")  # 3 steps left at 60 s each
    assert lines[-1].endswith("ETA 0:00:00")


def jumpy(step: int) -> dict:
    """Step times that alternate 0.1 s / 3.2 s for 570 tokens a step: 5700 <-> 178 tokens/s."""
    step_time = 0.1 if step % 2 else 3.2
    return {**row(step, step_time), "tokens_per_s": 570 / step_time}


def figures(line: str) -> tuple[int, str]:
    words = line.split()
    return int(words[words.index("tokens/s") + 1]), words[words.index("ETA") + 1]


def test_tokens_per_s_and_eta_are_a_moving_average_but_metrics_keep_each_step(tmp_path, caplog):
    log_dir = tmp_path / "run"
    res = resolve(load(None, [f"log.dir={log_dir}", "log.tensorboard=false", "train.steps=100"]), 1)
    reporter = Reporter(res)
    with caplog.at_level(logging.INFO, logger="dsnd.report.progress"):
        for step in range(1, 31):
            reporter.write(jumpy(step), {})
    reporter.close()
    shown = [figures(r.getMessage()) for r in caplog.records]
    assert shown[0] == (5700, "0:00:10")  # one step seen: its own figures
    # from the 10th step on: the last 10 steps (5 fast, 5 slow), 5700 tokens in 16.5 s
    assert {tokens for tokens, _ in shown[9:]} == {345}
    assert [eta for _, eta in shown[9:12]] == ["0:02:28", "0:02:27", "0:02:25"]  # 1.65 s a step
    with open(log_dir / "metrics.jsonl", encoding="utf-8") as f:
        raw = [json.loads(line)["tokens_per_s"] for line in f]
    assert [round(t) for t in raw[:4]] == [5700, 178, 5700, 178]


def test_rank_prefix_names_the_coordinates():
    topo = Topology(pp=2, dp=2, tp=2)
    assert rank_prefix(7, topo.coord(7)) == "[r7 pp1 dp1 tp1]"
    assert rank_prefix(2, topo.coord(2)) == "[r2 pp0 dp1 tp0]"
    with_cp = Topology(pp=1, dp=1, tp=2, cp=2)
    assert rank_prefix(3, with_cp.coord(3), cp=2) == "[r3 pp0 dp0 cp1 tp1]"
