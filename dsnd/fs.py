"""File-system helpers shared by the checkpoint commit and the model export (a leaf: imports
nothing of dsnd)."""

from __future__ import annotations

import os


def fsync(path: str) -> None:
    """Flush a file or a directory (its entries: a rename in it) to disk; the checkpoint
    commit's too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it (os.umask can only swap it, which would
    race with any other thread creating a file meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:  # no /proc (not Linux)
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
