"""Has the launcher that started this rank exited? A rank its launcher left behind stops at the
next step boundary and saves, as on SIGTERM (`dsnd.stop_request`).

Why: DeepSpeed 0.19.8's `deepspeed` runner, when its job has one host (`--num_gpus N`,
`--include localhost:...`, or a hostfile naming one host), starts `python -m
deepspeed.launcher.launch` with a plain `Popen` and sets no signal handler. SIGTERM or SIGINT to
the runner ends the runner alone; launch.py, which would pass the signal on to its ranks, is
never signalled, and it and its ranks train on as orphans (observed before this watch, with
`deepspeed --num_gpus 2`: SIGTERM to the runner at step 3 of 30, runner exit -15, the ranks
trained all 30 steps; `tests/integration/test_launchers.py`,
test_sigterm_to_deepspeed_hostfile_runner_saves_and_ends_every_rank, signals a one-host runner
alone: its exit is -15, and now every rank stops). Only with
many hosts does the runner answer SIGTERM itself (`pkill -f` of launch.py on every host, which
then sends SIGTERM to its ranks). Ctrl-C at a terminal reaches launch.py and the ranks too (one
process group), so only a signal to the runner's pid alone — `kill PID`, a scheduler, a service
manager — is lost.

So every rank a launcher started records, when `dsnd train` begins, its parent and, when that
parent is DeepSpeed's launch.py, launch.py's own parent (the runner), and at each step boundary
checks that each still has the parent it had: a process whose parent exits is re-parented (to
pid 1 or a subreaper). The check is one `getppid()` and one read of `/proc/PID/stat`, once per
optimizer step: no thread, no collective, nothing per micro-batch. (`prctl(PR_SET_PDEATHSIG)`
cannot serve: it fires on the death of the direct parent only — launch.py, which survives here —
and of the parent's thread that forked, not its process.)

Under the other launchers the watch is a backstop that changes nothing while the launcher
lives: `dsnd launch`'s agent SIGKILLs its ranks when it dies (PR_SET_PDEATHSIG); mpirun, srun,
torchrun pass signals on themselves. A rank whose launcher died anyway is orphaned under any of
them, and saving at the next step is what its SIGTERM would have done.

Not watched: a world of one that no launcher started (`nohup dsnd train &` outlives its shell
as before), and a rank whose parent at start is pid 1 or outside its pid namespace (0): it was
orphaned (or daemonised) before it could look.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dsnd.distributed.discover import discover

DEEPSPEED_LAUNCH = b"deepspeed.launcher.launch"  # in the command line of DeepSpeed's launch.py


def parent_of(pid: int) -> int | None:
    """`pid`'s parent pid (Linux /proc), or None when `pid` is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class LauncherWatch:
    """(pid, the parent it had) pairs: this process's own first, then launch.py's when the
    parent is DeepSpeed's launch.py."""

    def __init__(self, chain: list[tuple[int, int]]) -> None:
        self.chain = chain

    @classmethod
    def start(cls, env: Mapping[str, str]) -> LauncherWatch | None:
        """The watch for this process, or None where nothing is to be watched (see the module
        docstring). Call it first thing: a launcher that dies before it goes unnoticed."""
        info = discover(env)
        if info is not None and info.source == "single":
            return None
        me, parent = os.getpid(), os.getppid()
        if parent <= 1:
            return None
        chain = [(me, parent)]
        if DEEPSPEED_LAUNCH in _cmdline(parent):
            runner = parent_of(parent)
            if runner is not None and runner > 1:
                chain.append((parent, runner))
        return cls(chain)

    def gone(self) -> str | None:
        """None while every watched process keeps its parent; else which launcher exited."""
        me = os.getpid()
        for pid, parent in self.chain:
            now = os.getppid() if pid == me else parent_of(pid)
            if now != parent:
                return f"launcher pid {parent} exited"
        return None
