"""The one exception type for bad user input, and the exit codes of a rank.

Anything a user can fix (a config key, a hostfile line, a batch size) raises `UserError` with a
one-line message naming the file, key or line and the numbers involved. The CLI turns it into
``dsnd: error: <message>`` on stderr and exit code 2, with no traceback.

A rank's exit code tells its launcher why it ended, so that the job's one-line diagnosis names
the rank that failed first, and a restart is not wasted on a run that would fail again:

    0  done (or stopped on request, with a checkpoint)
    1  this rank failed (an exception of its own: a bug, a full disk, ...)
    2  bad input, found before any process group started
    3  training diverged (a non-finite loss or gradient norm): restarting would diverge again
    4  a peer failed first (a collective lost its connection or timed out)

A rank the NCCL watchdog aborts (a collective timed out, or its communicator failed) ends by
SIGABRT (-6; 134 through a shell) without running any Python: the launcher names it as an NCCL
watchdog abort (`dsnd.launcher.protocol.describe_exit`), behind a rank that failed by itself.
Whatever its ranks' codes, a failed job's launcher exits 1 (restartable with --max-restarts),
a bad input 2 before any rank starts.
"""

import difflib
from collections.abc import Iterable

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_PEER_FAILED = 4


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class UserError(Exception):
    """A problem in the user's input, reported as one line and exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # always exactly one line


class UserErrors(UserError):
    """Several problems in the user's input found at once: one line each (all reported, then
    exit code 2, so a config is fixed in one round, not one launch per problem)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = [" ".join(p.split()) for p in problems]
        Exception.__init__(self, "\n".join(self.problems))


def problems_of(error: UserError) -> list[str]:
    """The one-line problems an error reports."""
    return list(error.problems) if isinstance(error, UserErrors) else [str(error)]


def raise_all(problems: list[str]) -> None:
    """Raise the problems found, if any: one UserError, or UserErrors for several."""
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        raise UserErrors(problems)


class Diverged(Exception):
    """Training produced a non-finite loss, gradient norm or model state (exit code 3)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
