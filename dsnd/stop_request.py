"""A request to stop at the next step boundary (SIGTERM, e.g. preemption, or Ctrl-C).

The signal handler only raises a flag; the training loop carries each rank's flag in the per-step
all-gather it already makes (`dsnd.report.telemetry.gather_stats`), so every rank learns of a
request made on any rank at the same step, saves a checkpoint there and exits 0. A second SIGINT
means "now": it raises KeyboardInterrupt as Python's default handler would — except while a
checkpoint is being saved (`saving`), which it would leave half written: then it waits for the
save's commit and takes effect right after. A rank whose launcher exited asks to stop the same way
(`dsnd.distributed.launcher_watch`: signalling DeepSpeed's one-host runner reaches neither its
launch.py nor the ranks).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from dsnd.distributed.launcher_watch import LauncherWatch


class StopRequest:
    """While entered, SIGTERM/SIGINT only raise the flag; `signal_name` is the first signal
    received (or, once `watch` saw the launcher exit, which one), or None. Leaving restores the
    previous handlers."""

    def __init__(self, watch: LauncherWatch | None = None) -> None:
        self.signal_name: str | None = None
        self._signalled = False
        self._saving = self._held = False  # in a save; a second SIGINT came meanwhile
        self._watch = watch
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT and self._signalled:
            if not self._saving:
                raise KeyboardInterrupt
            if not self._held:
                os.write(
                    2,
                    b"dsnd: Ctrl-C again: stopping once the checkpoint being saved is committed\n",
                )
            self._held = True
            return
        self._signalled = True
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def ask(self, reason: str) -> None:
        """Ask to stop at the next step boundary, as a signal would (`reason` for the logs)."""
        self.signal_name = self.signal_name or reason

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint save: a second SIGINT inside it is held until it is done (and raises
        KeyboardInterrupt then, unless the save itself failed)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            held, self._held = self._held, False
        if held:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        """Read once per step (it looks at the launcher: a getppid and a /proc read)."""
        if self.signal_name is None and self._watch is not None:
            self.signal_name = self._watch.gone()
        return self.signal_name is not None
