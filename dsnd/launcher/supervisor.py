"""The launcher's side of a dsnd job: one agent per host, their output, their fate as one.

Each host's agent runs as a child of this process (locally, or as `ssh HOST ...`), in its own
session so that a Ctrl-C in the terminal reaches only this process, and set to die with it. This
process relays the agents' output, and:
- on the first rank failure any agent reports, tells every agent to `kill` (the failing host's
  agent has already ended its own ranks), so the whole job ends within seconds;
- on SIGTERM, or a first Ctrl-C, tells every agent to `term`: all ranks agree on a step, save
  and exit 0; a second Ctrl-C means `kill`;
- an agent that vanishes (ssh dropped, host down) counts as a failure of that host;
- agents that do not finish within KILL_GRACE_S of `kill` are killed with their ssh client.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from dsnd.launcher.agent import die_with_parent, tick
from dsnd.launcher.protocol import (
    AgentSpec,
    RankOutcome,
    cause_among,
    diagnose,
    diverged,
    parse_event,
)

KILL_GRACE_S = 15.0


@dataclasses.dataclass
class AgentLaunch:
    host: str
    argv: list[str]  # starts `python -m dsnd.launcher.agent` on the host
    spec: AgentSpec


@dataclasses.dataclass
class JobResult:
    outcomes: list[RankOutcome]
    failure: str | None  # one line naming the cause; None when every rank exited 0
    stop_signal: str | None  # the signal that asked the job to stop, if any
    diverged: bool = False  # training diverged: a restart would only diverge again
    regrow: bool = False  # ended (saved, exit 0) because `regrow` was set: start again, larger
    lost_hosts: list[str] = dataclasses.field(default_factory=list)  # agents without a report


class _Agent:
    def __init__(self, launch: AgentLaunch, inbox: queue.Queue, out: BinaryIO) -> None:
        self.host, self.inbox, self.out = launch.host, inbox, out
        self.proc = subprocess.Popen(
            launch.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.reported = False
        self.send(launch.spec.to_line())

    def send(self, data: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it is gone; its end is reported by `relay`

    def relay(self) -> None:
        """Thread: events to the inbox, everything else to our stdout; then the agent's end."""
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            event = parse_event(line)
            if event is None:
                self.out.write(line)
                self.out.flush()
            else:
                self.inbox.put(("event", self, event))
        self.inbox.put(("ended", self, self.proc.wait()))


class _Job:
    """The supervisor's view of a running job: which agents are alive, what they reported, and
    whether it was asked to stop, end (`kill`) or regrow."""

    def __init__(self, agents: list[_Agent]) -> None:
        self.alive = set(agents)
        self.stop_signal: list[str] = []
        self.outcomes: list[RankOutcome] = []
        self.lost_hosts: list[str] = []  # hosts whose agent ended without a report
        self.lost: list[str] = []  # and what that looked like, one line each
        self.kill_deadline: float | None = None
        self.regrowing = False

    def broadcast(self, word: str) -> None:
        if word == "kill" and self.kill_deadline is None:
            self.kill_deadline = time.monotonic() + KILL_GRACE_S
        for agent in self.alive:
            agent.send(word.encode() + b"\n")

    def handle(self, kind: str, agent: _Agent | None, item) -> None:
        if kind == "signal":
            again = bool(self.stop_signal)
            self.stop_signal.append(item)
            self.broadcast("kill" if again and item == "SIGINT" else "term")
        elif kind == "event" and item["event"] == "failed":
            self.broadcast("kill")
        elif kind == "event" and item["event"] == "exit":
            agent.reported = True
            self.outcomes += [RankOutcome(**o) for o in item["outcomes"]]
        elif kind == "ended":
            self.alive.discard(agent)
            if not agent.reported:
                self.lost_hosts.append(agent.host)
                self.lost.append(
                    f"the agent on host {agent.host} ended without a report "
                    f"(exit code {item}; unreachable or killed?)"
                )
                self.broadcast("kill")

    def look_around(self, regrow: threading.Event | None) -> None:
        """At every inbox item: a regrow asked for, agents past their kill grace."""
        if regrow is not None and regrow.is_set() and not (self.regrowing or self.stop_signal):
            self.regrowing = True
            self.broadcast("term")
        if self.kill_deadline is not None and time.monotonic() > self.kill_deadline:
            for a in self.alive:
                a.proc.kill()

    def result(self) -> JobResult:
        outcomes = sorted(self.outcomes, key=lambda o: o.rank)
        lost = self.lost
        # ranks that only saw a vanished host's ranks go (killed by their agents, or failing
        # their collectives) do not hide it: the host is named
        failure = lost[0] if lost and not cause_among(outcomes) else diagnose(outcomes)
        failure = failure or (lost[0] if lost else None)
        stopped = self.stop_signal[0] if self.stop_signal else None
        return JobResult(
            outcomes,
            failure,
            stopped,
            diverged(outcomes),
            regrow=self.regrowing and stopped is None and failure is None,
            lost_hosts=self.lost_hosts,
        )


def supervise(
    launches: list[AgentLaunch],
    out: BinaryIO | None = None,
    regrow: threading.Event | None = None,
) -> JobResult:
    """Run a job to its end; returns how every rank ended. Installs SIGINT/SIGTERM handlers for
    the duration (main thread only). Once `regrow` is set (an elastic job's missing host answers
    again), every agent is told `term`: the ranks save at the next step and exit 0, and the
    result says `regrow` (unless a stop request or a failure came first)."""
    out = out or sys.stdout.buffer
    inbox: queue.Queue = queue.Queue()
    agents = [_Agent(launch, inbox, out) for launch in launches]
    for agent in agents:
        threading.Thread(target=agent.relay, daemon=True).start()
    done = threading.Event()
    threading.Thread(target=tick, args=(inbox, ("tick", None, None), done), daemon=True).start()

    def on_signal(signum, _frame) -> None:
        inbox.put(("signal", None, signal.Signals(signum).name))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    job = _Job(agents)
    try:
        while job.alive:
            job.handle(*inbox.get())  # a "tick" arrives every POLL_S
            job.look_around(regrow)
    finally:
        done.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return job.result()
