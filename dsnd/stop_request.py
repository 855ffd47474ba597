"""A request to stop at the next step boundary (SIGTERM, e.g. preemption, or Ctrl-C).

The signal handler only raises a flag; the training loop carries each rank's flag in the per-step
all-gather it already makes (`dsnd.telemetry.gather_stats`), so every rank learns of a request
made on any rank at the same step, saves a checkpoint there and exits 0. A second SIGINT means
"now": it raises KeyboardInterrupt as Python's default handler would.
"""

from __future__ import annotations

import signal


class StopRequest:
    """While entered, SIGTERM/SIGINT only raise the flag; `signal_name` is the first signal
    received, or None. Leaving restores the previous handlers."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = self.signal_name or signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
