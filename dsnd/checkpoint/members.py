"""The files a checkpoint load may open, and the one form of every refusal.

A load reads only `member`s: regular files inside the step directory (no symbolic links, no
`..`) that manifest["files"] lists, so the checksums cover every byte it reads. A `Problem` is
one line "<file>: <what>"; `raise_problem` turns it into the CheckpointError
"<step_dir>/<file>: <what>". Shared by `verify` (the manifest and files) and `contents` (the
tensors in them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsnd.checkpoint.files import MANIFEST, CheckpointError


@dataclass(frozen=True)
class Problem:
    file: str  # path relative to the step directory
    what: str

    def __post_init__(self) -> None:
        # names come from the files themselves: one with a newline must not split the line
        object.__setattr__(self, "file", printable(self.file))
        object.__setattr__(self, "what", printable(self.what))

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def printable(text: str) -> str:
    """`text` with control characters escaped as Python would (\\n, \\x1b)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def raise_problem(step_dir: str, problem: Problem) -> None:
    """CheckpointError "<step_dir>/<file>: <what>", the one form every refusal takes."""
    raise CheckpointError(f"{os.path.join(step_dir, problem.file)}: {problem.what}")


def name_problem(rel: str, files: dict) -> str | None:
    """Why a load may not read `rel` whatever is on disk: outside, or no checksum covers it."""
    if os.path.isabs(rel) or ".." in rel.split("/"):
        return "lies outside the step directory"
    if rel == "." or not rel.isprintable() or os.path.normpath(rel) != rel:
        return "is not a plain relative path"  # ".", "a/./b", a NUL byte: no file a save writes
    if rel not in files:
        return f"is not listed in {MANIFEST}'s files, so no checksum covers it"
    return None


def member_problem(step_dir: str, files: dict, rel: str) -> str | None:
    """Why `rel` is not a file a load may read (None when it is): it must be a regular file
    inside `step_dir`, reached without symbolic links, and listed in the manifest's `files`."""
    what = name_problem(rel, files)
    if what:
        return what
    path = os.path.join(step_dir, rel)
    if os.path.islink(path):
        return "is a symbolic link (a checkpoint holds regular files only)"
    if not os.path.lexists(path):
        return "missing"
    if os.path.realpath(path) != os.path.join(os.path.realpath(step_dir), rel):
        return "lies outside the step directory (through a symbolic link)"
    if not os.path.isfile(path):
        return "is not a regular file"
    return None


def member(step_dir: str, manifest: dict, rel: str) -> str:
    """The path of `rel` in `step_dir`, the only way a load opens a checkpoint file;
    CheckpointError naming it unless `member_problem` finds nothing."""
    what = member_problem(step_dir, manifest["files"], rel)
    if what:
        raise_problem(step_dir, Problem(rel, what))
    return os.path.join(step_dir, rel)
