"""The directories a run writes to: writable before the first step, and one writer at a time.

A read-only root would otherwise be found at the first save, after every step of work before it;
two runs on one root would delete each other's temporary directories and interleave `latest`
(and two on one log.dir, their metrics.jsonl).

The lock is `flock(2)` on `<dir>/.dsnd.lock`, held by rank 0 of `dsnd train` for the whole run.
The kernel drops it when the holder exits in any way, SIGKILL included, so a crashed job never
blocks its own restart (a marker file would). The holder writes who it is into the file, so the
refusal names it. flock works across hosts on NFS v4 (as a byte-range lock) and on local disks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid

from dsnd.checkpoint.files import CheckpointError

LOCK_FILE = ".dsnd.lock"


def _missing(path: str) -> list[str]:
    """`path` and those of its parents that do not exist, deepest first."""
    out, path = [], os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out


def check_writable(path: str, what: str, keep: bool = True) -> None:
    """Create `path` if needed and write and remove a file in it; CheckpointError (one line)
    when that fails. `keep=False` removes again the directories it made: an export's target is
    made by the export alone, so a run stopped before it (or refused) leaves no empty one."""
    made = [] if keep else _missing(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".dsnd-write-test-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"{what} {path} is not writable ({e.strerror or e}); nothing was started"
        ) from None
    finally:
        for directory in made:
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _holder_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return "another process"
    if not isinstance(holder, dict):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    job = holder.get("job_id")
    # `dsnd train` names its job before it locks; only a preflight probe holds it without one
    who = f"job {job}" if job else "a dsnd process without a job id"
    return f"{who} (pid {holder.get('pid')} on host {holder.get('host')}, since {since})"


class RootLock:
    """Exclusive use of a directory a run writes to (`what`: the config key that names it).
    `acquire` raises CheckpointError naming the holder when another live process has it;
    `release` (or the process ending) frees it."""

    def __init__(self, root: str, what: str = "checkpoint.dir") -> None:
        self.root, self.what = root, what
        self.path = os.path.join(root, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self, job_id: str | None) -> RootLock:
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"{self.path}: cannot lock ({e.strerror})") from None
            raise CheckpointError(
                f"{self.what} {self.root} is in use by {_holder_text(self.path)}: one run writes "
                f"to it at a time (wait for it to end, or set another {self.what})"
            ) from None
        holder = {
            "job_id": job_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


def run_dirs(checkpoint_dir: str, log_dir: str) -> list[tuple[str, str]]:
    """The directories one run owns, as (path, config key): the checkpoint root, and log.dir
    (metrics.jsonl, TensorBoard files, rank logs) unless it holds the root anyway."""
    dirs = [(checkpoint_dir, "checkpoint.dir")]
    ck, logs = os.path.realpath(checkpoint_dir), os.path.realpath(log_dir)
    if os.path.commonpath([ck, logs]) != logs:
        dirs.append((log_dir, "log.dir"))
    return dirs


def probe_lock(root: str, what: str = "checkpoint.dir") -> str | None:
    """None when nobody holds `root`'s lock now, else the refusal (for the launcher's preflight;
    the lock is taken and dropped at once)."""
    if not os.path.isfile(os.path.join(root, LOCK_FILE)):
        return None  # never locked: nothing to ask (and nothing left behind by asking)
    try:
        RootLock(root, what).acquire(None).release()
    except CheckpointError as e:
        return str(e)
    return None
