"""A rank's heartbeat: proof to its host's agent that the process is still scheduled.

A daemon thread touches the file the agent named in DSND_HEARTBEAT_FILE every second. A stopped
(SIGSTOP), frozen or swapped-out process stops touching it, and the agent ends the job once the
file is older than `dist.timeout_s`, naming this rank. A rank that is alive but blocked in a
collective keeps beating: that case ends through the collective's own timeout instead.
Without DSND_HEARTBEAT_FILE (DeepSpeed's launcher, mpirun, torchrun) there is no heartbeat.
"""

from __future__ import annotations

import os
import threading

ENV_FILE = "DSND_HEARTBEAT_FILE"
INTERVAL_S = 1.0


def start_heartbeat(environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Start beating if this rank was started by a dsnd agent; returns the thread or None."""
    path = (os.environ if environ is None else environ).get(ENV_FILE)
    if not path:
        return None
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(INTERVAL_S):
            try:
                os.utime(path)
            except OSError:  # the agent removed its directory: the job is ending
                return

    thread = threading.Thread(target=beat, name="dsnd-heartbeat", daemon=True)
    thread.start()
    return thread
