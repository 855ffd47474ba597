"""The one exception type for bad user input, and the exit codes of a rank.

Anything a user can fix (a config key, a hostfile line, a batch size) raises `UserError` with a
one-line message naming the file, key or line and the numbers involved. The CLI turns it into
``dsnd: error: <message>`` on stderr and exit code 2, with no traceback.

A rank's exit code tells its launcher why it ended, so that the job's one-line diagnosis names
the rank that failed first, and a restart is not wasted on a run that would fail again:

    0  done (or stopped on request, with a checkpoint)
    1  this rank failed (an exception of its own: a bug, a full disk, ...); a save or a write to
       log.dir that the disk refused (ENOSPC, any OSError) is one line (`WriteFailed`), the
       previous checkpoint kept (`latest` unchanged, the unfinished one removed)
    2  bad input, found before any process group started
    3  training diverged (a non-finite loss or gradient norm): restarting would diverge again
    4  a peer failed first (a collective lost its connection or timed out, or its save
       failed on another rank)
  130  interrupted by a second Ctrl-C (SIGINT): one line; a save under way finishes first

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
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd command


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


SHOWN = 80  # characters of a value an error echoes
LONGEST_WORD = 300  # past this, a word of an error line is an echoed value, not a name


def shorten(text: str, keep: int = SHOWN) -> str:
    """`text`, or its first `keep` characters and how long it was ("… (N chars)")."""
    return text if len(text) <= keep + 20 else f"{text[:keep]}… ({len(text)} chars)"


def shown(value: object) -> str:
    """repr(value) for an error line, shortened: a 100 KB `--set` value is not echoed whole."""
    return shorten(repr(value))


def _one_line(message: str) -> str:
    """`message` on one line, each overlong word (an echoed value) shortened."""
    return " ".join(shorten(word) if len(word) > LONGEST_WORD else word for word in message.split())


class UserError(Exception):
    """A problem in the user's input, reported as one line and exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))  # always exactly one line


class UserErrors(UserError):
    """Several problems in the user's input found at once: one line each (all reported, then
    exit code 2, so a config is fixed in one round, not one launch per problem)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = [_one_line(p) for p in problems]
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


class WriteFailed(Exception):
    """Writing a run's output failed (a checkpoint save or log.dir the disk refused): one line
    and exit code `code` — EXIT_FAILED on the rank whose write failed, EXIT_PEER_FAILED on the
    ranks that learnt of it — with no traceback on the console (the rank's log keeps it)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code
