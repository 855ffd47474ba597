"""What the launcher and a host's agent say to each other, as pure data.

The launcher writes one JSON line (the `AgentSpec`) to the agent's stdin, then single words:
`term` (SIGTERM every rank: save at the next step and exit) or `kill` (SIGKILL every rank now).
The agent writes its ranks' output lines to stdout unchanged, and its events as lines starting
with EVENT_PREFIX. The spec travels over stdin rather than the command line, so variable values
never pass through a remote shell (quotes, `$`, newlines arrive byte for byte) and never show in
`ps`.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field

from dsnd.errors import EXIT_DIVERGED, EXIT_PEER_FAILED, EXIT_USAGE
from dsnd.launcher.devices import visible_devices_env

EVENT_PREFIX = b"@@dsnd-agent "
STOPPED_AFTER_S = 5.0
"""A rank that had been stopped this long when the job ended was frozen, whatever failed first."""


@dataclass
class AgentSpec:
    """Everything one host's agent needs to start and watch its ranks."""

    host: str
    ranks: list[int]  # global ranks on this host; local rank = position in this list
    world_size: int
    master_addr: str
    master_port: int
    argv: list[str]  # the program every rank runs
    cwd: str
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's own environment
    hang_timeout_s: float = 300.0  # a rank stopped for longer ends the job
    devices: list[int] = field(default_factory=list)  # the host's selected slots (GPU ids)

    def to_line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> AgentSpec:
        return cls(**json.loads(line))

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """The variables torchrun / DeepSpeed's launch.py set for a rank, plus the spec's; the
        host's selected slots as CUDA_VISIBLE_DEVICES over any other value (`devices`)."""
        return {
            **self.env,
            **(visible_devices_env(self.devices) if self.devices else {}),
            "RANK": str(self.ranks[local_rank]),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(len(self.ranks)),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def event_line(kind: str, **data) -> bytes:
    return EVENT_PREFIX + json.dumps({"event": kind, **data}).encode() + b"\n"


def parse_event(line: bytes) -> dict | None:
    """The event in an agent's output line, or None for a rank's own output."""
    if not line.startswith(EVENT_PREFIX):
        return None
    return json.loads(line[len(EVENT_PREFIX) :])


@dataclass
class RankOutcome:
    """How one rank ended, as its agent saw it."""

    rank: int
    host: str
    code: int | None  # exit code; negative = killed by that signal; None = never started
    stopped_s: float  # how long it had been stopped (process state T) when it ended
    ended_by_agent: bool  # the agent killed it because the job was ending
    ended_at: float = 0.0  # wall-clock time it ended (the hosts' clocks are assumed in sync)
    reason: str = ""  # the agent's own finding (hung, ...)


_MEANING = {
    EXIT_USAGE: "bad input",
    EXIT_DIVERGED: "training diverged",
    EXIT_PEER_FAILED: "a peer failed first",
}


ABORT_CODES = (-signal.SIGABRT, 128 + signal.SIGABRT)
"""How a rank killed by SIGABRT ends: -6 as its parent sees it, 134 through a shell."""
WATCHDOG = (
    "NCCL watchdog abort (collective timeout?): a collective outlived dist.timeout_s or "
    "its communicator failed; torch's flight recorder dump, if any, is <log.dir>/logs/"
    "nccl_trace_rank_<rank>"
)


def aborted(code: int | None) -> bool:
    """Whether exit code `code` is a SIGABRT's (on NCCL, most often the watchdog's)."""
    return code in ABORT_CODES


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not start"
    if code == -signal.SIGABRT:
        return f"was killed by SIGABRT: {WATCHDOG}"
    if code == 128 + signal.SIGABRT:
        return f"exited with code {code} (128 + SIGABRT): {WATCHDOG}"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    meaning = f" ({_MEANING[code]})" if code in _MEANING else ""
    return f"exited with code {code}{meaning}"


def diverged(outcomes: list[RankOutcome]) -> bool:
    """True when the job ended because training diverged (a restart would diverge again)."""
    return any(o.code == EXIT_DIVERGED and not o.ended_by_agent for o in outcomes)


def diagnose(outcomes: list[RankOutcome]) -> str | None:
    """One line naming the rank that brought the job down, or None when every rank succeeded.

    A frozen (stopped) rank is the cause even when a peer's collective timed out first.
    Otherwise a rank killed by a signal it did not get from its agent (SIGKILL, SIGSEGV, the OOM
    killer) comes before ranks that exited with an error, those before ranks the NCCL watchdog
    aborted (SIGABRT: a collective timed out or its communicator failed, often because a peer
    died), and those before ranks that exited saying a peer failed first (EXIT_PEER_FAILED),
    since one rank's death makes the others' collectives fail a few milliseconds later —
    sometimes before the failing rank has finished exiting, so the time of exit alone names the
    wrong rank; among equals, the earliest.
    """
    if all(o.code == 0 for o in outcomes):
        return None
    frozen = [
        o for o in outcomes if o.reason or (o.ended_by_agent and o.stopped_s >= STOPPED_AFTER_S)
    ]
    if frozen:
        o = max(frozen, key=lambda o: (bool(o.reason), o.stopped_s))
        what = o.reason or f"was stopped (frozen for {o.stopped_s:.0f} s)"
        return f"rank {o.rank} on host {o.host} {what}"
    failed = [o for o in outcomes if o.code != 0 and not o.ended_by_agent]
    failed.sort(key=lambda o: (_consequence_rank(o.code), o.ended_at, o.rank))
    if failed:
        o = failed[0]
        return f"rank {o.rank} on host {o.host} {describe_exit(o.code)}"
    o = next(o for o in outcomes if o.code != 0)
    return f"rank {o.rank} on host {o.host} {describe_exit(o.code)}"


def failed_on_their_own(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """The ranks that ended with an error or a signal from outside, not as a consequence of a
    peer's failure (a SIGABRT, "a peer failed first") and not killed by their agent because the
    job was ending."""
    return [
        o
        for o in outcomes
        if o.code != 0 and not o.ended_by_agent and _consequence_rank(o.code) < 2
    ]


def cause_among(outcomes: list[RankOutcome]) -> bool:
    """Whether some reported rank can have caused the failure itself: it froze, or it failed on
    its own (`failed_on_their_own`). When none did and a host's agent vanished, the vanished
    host is the cause."""
    frozen = any(
        o.reason or (o.ended_by_agent and o.stopped_s >= STOPPED_AFTER_S) for o in outcomes
    )
    return frozen or bool(failed_on_their_own(outcomes))


def _consequence_rank(code: int | None) -> int:
    """0 a signal from outside, 1 an error exit, 2 a SIGABRT (the NCCL watchdog), 3 "a peer
    failed first": the lower, the likelier the cause (see `diagnose`)."""
    if aborted(code):
        return 2
    if code == EXIT_PEER_FAILED:
        return 3
    return 0 if (code or 0) < 0 else 1
