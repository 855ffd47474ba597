"""A host's agent: starts this host's ranks, watches them, and ends them together.

`python -m dsnd.launcher.agent` reads its `AgentSpec` from stdin (see `protocol`), then:
- starts one process per rank, each in its own session (a signal to the group reaches the rank's
  children too) and set to die with the agent (PR_SET_PDEATHSIG), so no rank outlives it;
- passes each rank's stdout and stderr through, line by line;
- a rank that exits non-zero, or stays stopped (process state T: SIGSTOP, a debugger) longer
  than `hang_timeout_s`, ends every rank on this host at once and is reported as an event; one
  that exits saying a peer failed first, or that the NCCL watchdog aborted (SIGABRT, most often
  because a peer died), is reported PEER_GRACE_S later unless the cause is found first;
- `term` from the launcher sends SIGTERM to every rank (they save at the next step and exit 0);
  `kill`, or the launcher going away (end of stdin: its ssh connection closed), SIGKILLs them;
- when every rank has ended, a last `exit` event lists how each one ended.

DeepSpeed's launch.py cannot serve here: it gives stopped ranks 30 s after SIGTERM, exits 1 on
SIGTERM, and its multi-node runner `pkill`s by command line on every host.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from dsnd.errors import EXIT_PEER_FAILED
from dsnd.launcher.protocol import AgentSpec, RankOutcome, aborted, describe_exit, event_line

_PR_SET_PDEATHSIG = 1
POLL_S = 0.2
PEER_GRACE_S = 10.0
"""How long a rank's exit saying "a peer failed first" (EXIT_PEER_FAILED) waits for the peer's
own exit before the job is ended: the failing rank closes its connections while it is still
tearing down, so its peers can exit first (without it a rank failing in a save was killed by its
agent, still exiting, after its peer's code-4 exit, and the job named the peer:
`tests/integration/test_job_faults.py::test_the_rank_whose_disk_filled_is_named_not_its_peer`)."""


def die_with_parent() -> None:
    """In a child before exec: default SIGINT/SIGHUP (an agent ignores them, and ignored signals
    are inherited), and the kernel SIGKILLs the child when its parent exits (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_state(pid: int) -> str:
    """The kernel's one-letter state (R, S, D, T = stopped, Z, ...), or '?' when unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class Output:
    """Whole lines to one stream, one writer at a time, so events never split a rank's line.
    An error line (`dsnd: error: ...`) that another rank of this host already wrote is written
    once: ranks that stop for the same reason (a divergence) all say so."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.lock = stream, threading.Lock()
        self.errors_said: set[bytes] = set()

    def write(self, data: bytes) -> None:
        with self.lock:
            if data.startswith(b"dsnd: error: "):
                if data in self.errors_said:
                    return
                self.errors_said.add(data)
            try:
                self.stream.write(data)
                self.stream.flush()
            except (BrokenPipeError, ValueError):  # the launcher is gone; keep ending ranks
                pass


def _pump(source: BinaryIO, sink: Output) -> None:
    for line in iter(source.readline, b""):
        sink.write(line)
    source.close()


class Rank:
    """One rank's process, how long it has been stopped, and how it ended.

    Liveness is read from outside, in /proc: a rank-side heartbeat thread was tried first, but
    on these machines such a thread sometimes never woke from its one-second sleep (3 of 12
    ranks, py-spy: idle in the sleep), which would end healthy jobs. A rank that is alive but
    stuck ends through its peers' collective timeout (`dist.timeout_s`) instead."""

    def __init__(self, spec: AgentSpec, local_rank: int, inbox: queue.Queue) -> None:
        self.rank, self.host = spec.ranks[local_rank], spec.host
        self.stopped_since: float | None = None  # monotonic time it was first seen stopped
        self.ended_by_agent, self.reason = False, ""
        self.ended_at, self.stopped_at_end = 0.0, 0.0
        env = {**os.environ, **spec.rank_env(local_rank)}
        # a working directory deleted since the launch (rm -rf of a checkout, mid-run) must not
        # stop a restart: the ranks then start in / (not in the deleted directory: torch's MKL
        # aborts loading there), and `dsnd launch` passed every path of the config absolute
        cwd = spec.cwd if os.path.isdir(spec.cwd) else "/"
        self.proc = subprocess.Popen(
            spec.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.inbox = inbox

    def watch(self) -> None:
        """Thread: report this rank's exit to the agent's inbox the moment it happens."""
        self.proc.wait()
        self.ended_at = time.time()
        self.inbox.put(("exited", self))

    def stopped_for(self) -> float:
        """Seconds it has been stopped without a break, as seen at each call (every tick)."""
        if process_state(self.proc.pid) not in ("T", "t"):
            self.stopped_since = None
            return 0.0
        now = time.monotonic()
        self.stopped_since = self.stopped_since or now
        return now - self.stopped_since

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int, group: bool = False) -> None:
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        if self.running():
            self.stopped_at_end = self.stopped_for()
            self.ended_by_agent = True
            self.signal(signal.SIGKILL, group=True)

    def outcome(self) -> RankOutcome:
        return RankOutcome(
            self.rank,
            self.host,
            self.proc.returncode,
            self.stopped_at_end,
            self.ended_by_agent,
            self.ended_at,
            self.reason,
        )


def tick(inbox: queue.Queue, item: tuple, done: threading.Event | None = None) -> None:
    """Thread: put `item` every POLL_S until `done` is set, so that the owner can block in
    inbox.get() (no timed lock waits: see `Rank`) and still look around regularly."""
    while done is None or not done.is_set():
        time.sleep(POLL_S)
        inbox.put(item)


def _read_commands(stdin: BinaryIO, inbox: queue.Queue) -> None:
    for line in iter(stdin.readline, b""):
        inbox.put(("command", line.strip().decode()))
    inbox.put(("command", "eof"))


class Agent:
    def __init__(self, spec: AgentSpec, stdin: BinaryIO, out: Output, err: Output) -> None:
        self.spec, self.out = spec, out
        self.inbox: queue.Queue = queue.Queue()
        self.ranks = [Rank(spec, i, self.inbox) for i in range(len(spec.ranks))]
        self.ending: str | None = None  # None, "term" or "kill"
        self.peer_failed: tuple[Rank, float] | None = None  # first "a peer failed" / SIGABRT
        self.pumps = [
            threading.Thread(target=_pump, args=(pipe, sink), daemon=True)
            for r in self.ranks
            for pipe, sink in ((r.proc.stdout, out), (r.proc.stderr, err))
        ]
        others = [threading.Thread(target=r.watch, daemon=True) for r in self.ranks] + [
            threading.Thread(target=_read_commands, args=(stdin, self.inbox), daemon=True),
            threading.Thread(target=tick, args=(self.inbox, ("tick", None)), daemon=True),
        ]
        for t in self.pumps + others:
            t.start()
        self.out.write(
            event_line("started", host=spec.host, pids={r.rank: r.proc.pid for r in self.ranks})
        )

    def _fail(self, rank: Rank, what: str) -> None:
        """The first failure on this host: report it and end the other ranks now."""
        if self.ending == "kill":
            return
        self.out.write(event_line("failed", rank=rank.rank, host=self.spec.host, what=what))
        self._kill_all()

    def _kill_all(self) -> None:
        self.ending = "kill"
        for r in self.ranks:
            r.kill()

    def _on_command(self, word: str) -> None:
        if word == "term" and self.ending is None:
            self.ending = "term"
            for r in self.ranks:
                r.signal(signal.SIGTERM)
        elif word in ("kill", "eof"):
            self._kill_all()

    def _check_stopped(self) -> None:
        for r in self.ranks:
            if r.running() and (stopped := r.stopped_for()) > self.spec.hang_timeout_s:
                r.reason = (
                    f"was stopped (SIGSTOP or a debugger) for {stopped:.0f} s "
                    f"(dist.timeout_s={self.spec.hang_timeout_s:g})"
                )
                self._fail(r, r.reason)
                return

    def _on_exit(self, rank: Rank) -> None:
        code = rank.proc.returncode
        if code == 0 or rank.ended_by_agent:
            return
        if code == EXIT_PEER_FAILED or aborted(code):  # likely a consequence: wait a little
            self.peer_failed = self.peer_failed or (rank, time.monotonic())
            return
        self._fail(rank, describe_exit(code))

    def _check_peer_failed(self) -> None:
        """A rank said a peer failed first (or the NCCL watchdog aborted it), and no rank of this
        host failed since: after PEER_GRACE_S it is the failure to report (the cause is
        elsewhere, or stuck)."""
        if self.peer_failed and time.monotonic() - self.peer_failed[1] > PEER_GRACE_S:
            rank = self.peer_failed[0]
            self._fail(rank, describe_exit(rank.proc.returncode))

    def run(self) -> int:
        ended: set[int] = set()
        # a waiting "peer failed" / SIGABRT exit is reported after its grace even when no rank of
        # this host is left: without that event the launcher would not end the other hosts
        while len(ended) < len(self.ranks) or (self.peer_failed and self.ending != "kill"):
            kind, item = self.inbox.get()  # a "tick" arrives every POLL_S
            if kind == "command":
                self._on_command(item)
            elif kind == "exited":
                ended.add(item.rank)
                self._on_exit(item)
            if self.ending != "kill":
                self._check_stopped()
                self._check_peer_failed()
        for r in self.ranks:  # whatever a rank left behind in its session goes too
            r.signal(signal.SIGKILL, group=True)
        for t in self.pumps:  # the last lines of output (the rank's group is gone: pipes close)
            t.join(timeout=5)
        outcomes = [dataclasses.asdict(r.outcome()) for r in self.ranks]
        self.out.write(event_line("exit", host=self.spec.host, outcomes=outcomes))
        return 0 if all(r.proc.returncode == 0 for r in self.ranks) else 1


def main() -> int:
    stdin = sys.stdin.buffer
    spec = AgentSpec.from_line(stdin.readline())
    # the launcher's Ctrl-C reaches us only as `term`/`kill`; a hangup (ssh gone) is end of stdin
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None)  # handled as a command below
    agent = Agent(spec, stdin, Output(sys.stdout.buffer), Output(sys.stderr.buffer))
    signal.signal(signal.SIGTERM, lambda *_: agent.inbox.put(("command", "term")))
    return agent.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the thread blocked reading stdin would abort the shutdown
