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
import logging
import os
import sys
from typing import TextIO

from dsnd.topology import Coord

log = logging.getLogger("dsnd.progress")

WINDOW = 10  # steps the progress line's tokens/s and ETA average over


def rank_prefix(rank: int, coord: Coord, cp: int = 1) -> str:
    """``[r<rank> pp<i> dp<i> tp<i>]``, with ``cp<i>`` before tp when the run has cp > 1."""
    cp = f" cp{coord.cp}" if cp > 1 else ""
    return f"[r{rank} pp{coord.pp} dp{coord.dp}{cp} tp{coord.tp}]"


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, every: int, stream: TextIO | None = None) -> None:
        self.total, self.every = total, max(every, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)

    def line(self, row: dict) -> str:
        """The progress text of a metrics row (step, loss, lr, grad_norm, tokens_per_s,
        step_time_s); tokens/s and the ETA over the last `WINDOW` rows."""
        step, seconds = row["step"], row["step_time_s"]
        self.recent.append((row["tokens_per_s"] * seconds, seconds))
        spent = sum(s for _, s in self.recent)
        # total tokens over total time: a mean of per-step rates would let one fast step dominate
        tokens_per_s = sum(t for t, _ in self.recent) / spent if spent else row["tokens_per_s"]
        eta = spent / len(self.recent) * (self.total - step)
        evaluated = f" eval_loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""
        return (f"step {step}/{self.total} loss {row['loss']:.4f}{evaluated} lr {row['lr']:.2e} "
                f"grad_norm {row['grad_norm'] or 0.0:.3f} tokens/s {tokens_per_s:.0f} "
                f"ETA {_clock(eta)}")  # fmt: skip

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
        handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s",
                                               datefmt="%H:%M:%S"))  # fmt: skip
        handler.setLevel(level)


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, "logs", f"rank_{rank:05d}.log")


class RankLogFile:
    """Every record of this rank's `dsnd` and DeepSpeed loggers, at INFO and above, in
    `<log_dir>/logs/rank_XXXXX.log` (other ranks are quiet on the console by default)."""

    def __init__(self, log_dir: str, rank: int, coord: Coord) -> None:
        self.path = rank_log_path(log_dir, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.handler = logging.FileHandler(self.path, encoding="utf-8")
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
