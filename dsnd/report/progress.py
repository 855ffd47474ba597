"""Rank 0's progress: a live line on a terminal, plain log lines elsewhere (files, CI, pipes);
and every rank's full log in a file under `log.dir/logs/`.

The live line is rewritten in place (carriage return) every step: step, loss, tokens/s and the
estimated time left. Off a terminal the same text goes to the log every `log.every` steps, so
captured output stays readable.

tokens/s and the ETA are over the last `WINDOW` steps: one step's own figure swings widely (on a
shared CPU, 177 and 5780 tokens/s on alternate steps), which made the line and its ETA jump.
metrics.jsonl keeps each step's own figures.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
from typing import TextIO

from dsnd.topology import Coord

log = logging.getLogger("dsnd.report.progress")

WINDOW = 10  # steps the progress line's tokens/s and ETA average over


def rank_prefix(rank: int, coord: Coord, cp: int = 1) -> str:
    """``[r<rank> pp<i> dp<i> tp<i>]``, with ``cp<i>`` before tp when the run has cp > 1."""
    cp = f" cp{coord.cp}" if cp > 1 else ""
    return f"[r{rank} pp{coord.pp} dp{coord.dp}{cp} tp{coord.tp}]"


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RecentRate:
    """tokens/s over the last `WINDOW` steps: their tokens over their time (a mean of per-step
    rates would let one fast step dominate), and their mean step time."""

    def __init__(self) -> None:
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)

    def add(self, tokens_per_s: float, seconds: float | None) -> float:
        """Take one step's figures; tokens/s over the window. Without `seconds` (a metrics row
        written before step_time_s was recorded) the step is taken to be 1 / tokens_per_s long:
        every step of a run has the same tokens, so the window's rate is the same."""
        if seconds is None:
            seconds = 1.0 / tokens_per_s if tokens_per_s else 0.0
        self.recent.append((tokens_per_s * seconds, seconds))
        spent = sum(s for _, s in self.recent)
        return sum(t for t, _ in self.recent) / spent if spent else tokens_per_s

    @property
    def step_seconds(self) -> float:
        return sum(s for _, s in self.recent) / len(self.recent) if self.recent else 0.0


def smoothed_rates(rows: list[dict]) -> list[float]:
    """The tokens/s the progress line showed at each metrics row (`RecentRate` over the rows in
    order), its window restarted where a run started or resumed (a row with "run_start"), as a
    new process's progress line restarts."""
    rate, out = RecentRate(), []
    for row in rows:
        if "run_start" in row:
            rate = RecentRate()
        out.append(rate.add(row["tokens_per_s"], row.get("step_time_s")))
    return out


class Progress:
    def __init__(self, total: int, every: int, stream: TextIO | None = None) -> None:
        self.total, self.every = total, max(every, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.rate = RecentRate()

    def line(self, row: dict) -> str:
        """The progress text of a metrics row (step, loss, lr, grad_norm, tokens_per_s,
        step_time_s); tokens/s and the ETA over the last `WINDOW` rows."""
        step = row["step"]
        tokens_per_s = self.rate.add(row["tokens_per_s"], row["step_time_s"])
        eta = self.rate.step_seconds * (self.total - step)
        evaluated = f" eval_loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""
        return (
            f"step {step}/{self.total} loss {row['loss']:.4f}{evaluated} lr {row['lr']:.2e} "
            f"grad_norm {row['grad_norm'] or 0.0:.3f} tokens/s {tokens_per_s:.0f} "
            f"ETA {_clock(eta)}"
        )

    def update(self, row: dict) -> None:
        step = row["step"]
        text = self.line(row)
        if self.live:
            end = "\n" if step == self.total else ""
            self.stream.write(f"\r\033[K{text}{end}")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            log.info(text)


def use_console_prefix(prefix: str, level: int) -> None:
    """Console lines start with the rank's coordinates; the console keeps `level` even when a
    logger is opened wider for the rank's log file."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(
            logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
        )
        handler.setLevel(level)


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, "logs", f"rank_{rank:05d}.log")


class _LogFileHandler(logging.FileHandler):
    """A rank's log file whose write the disk refuses (a full log.dir): said once, in one line,
    and the file given up — logging's own handling prints a traceback for every record."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        if not self.failed:
            self.failed = True
            sys.stderr.write(
                f"dsnd: cannot write {self.baseFilename} ({error.strerror or error}); "
                "this rank's log stops there\n"
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):  # what a full disk still refuses to take
            super().close()


class RankLogFile:
    """Every record of this rank's `dsnd` and DeepSpeed loggers, at INFO and above, in
    `<log_dir>/logs/rank_XXXXX.log` (other ranks are quiet on the console by default)."""

    def __init__(self, log_dir: str, rank: int, coord: Coord) -> None:
        self.path = rank_log_path(log_dir, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.handler = _LogFileHandler(self.path, encoding="utf-8")
        self.handler.setLevel(logging.INFO)
        self.handler.setFormatter(
            logging.Formatter(
                f"{rank_prefix(rank, coord)} %(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        )
        self.loggers = [logging.getLogger("dsnd"), logging.getLogger("DeepSpeed")]
        self.saved_levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.addHandler(self.handler)
            if lg.getEffectiveLevel() > logging.INFO:  # console handlers keep their own level
                lg.setLevel(logging.INFO)

    def exception(self, message: str, *args) -> None:
        """The exception being handled, with its traceback, into this file only (the console
        gets what the caller decides)."""
        record = logging.getLogger("dsnd").makeRecord(
            "dsnd", logging.ERROR, __file__, 0, message, args, sys.exc_info()
        )
        self.handler.handle(record)

    def close(self) -> None:
        for lg, level in zip(self.loggers, self.saved_levels, strict=True):
            lg.removeHandler(self.handler)
            lg.setLevel(level)
        self.handler.close()
