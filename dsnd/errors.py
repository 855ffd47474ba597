"""The one exception type for bad user input.

Anything a user can fix (a config key, a hostfile line, a batch size) raises `UserError` with a
one-line message naming the file, key or line and the numbers involved. The CLI turns it into
``dsnd: error: <message>`` on stderr and exit code 2, with no traceback.
"""


class UserError(Exception):
    """A problem in the user's input, reported as one line and exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # always exactly one line
