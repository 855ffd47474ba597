"""Asynchronous checkpoints (`checkpoint.async: true`): a background thread writes a save's files
while training goes on, and the save is committed once every rank's files are on disk.

The training thread does every collective part of the save (`dsnd.checkpoint.save`'s
`start_async_save`): the full state gathered and copied to host memory (`HostCopies`), the
finiteness all-reduce, the manifest's contents as they are at the step (optimizer step, learning
rate schedule, loss scaler, RNG state) and every rank's file names gathered to rank 0 (the names
are known before anything is written). Then it hands this rank's writes to its `AsyncWriter` and
trains on. The writer thread makes no torch.distributed call: the collectives of one group must
be issued in the same order on every rank (NCCL), and a background thread's would interleave with
training's in a different order on each. The ranks meet through the checkpoint directory instead,
which every rank already shares:

1. Each rank's writer writes its files into `<root>/.tmp-step_N/` as a synchronous save does
   (each through a temporary name, fsynced, renamed), then the marker `.written-rank-R`, or
   `.failed-rank-R` holding what went wrong.
2. Rank 0's writer, its own files written, polls for every rank's marker (for at most
   `dist.timeout_s`). When every one says written it removes the markers (the manifest never
   lists them), writes the manifest, renames the directory, moves `latest`, prunes, and logs the
   commit. Otherwise it commits nothing.
3. One save is in flight at most: the next save, and the end of training, first join the writer
   (`AsyncWriter.wait`); the training thread then makes every rank agree in one all-reduce whether
   the save succeeded everywhere (`dsnd.checkpoint.failure.agree`). If not, rank 0 removes the
   temporary directory (every writer has finished by then), `latest` stays on the previous
   checkpoint and every rank raises `WriteFailed`, as after a synchronous save that failed.

A process killed mid-write leaves `latest` on the previous checkpoint and a `.tmp-` directory
that the next start removes (`dsnd.checkpoint.commit.remove_temporaries`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsnd.checkpoint.commit import write_atomic

log = logging.getLogger(__name__)

WRITTEN = ".written-rank-"
FAILED = ".failed-rank-"
POLL_S = 0.05
WRITER_NICE = 10
"""The writer thread's niceness (Linux: a thread's own; elsewhere left as it is). Where the
cores are all busy the writer yields them to training, and still moves (about a tenth of a core
against one busy thread at 0). `dsnd bench checkpoint`'s model on this 2-core machine while other
jobs ran, four saves each: steps while a write was in flight 1.11-1.25x a step without one,
against 1.17-1.65x at the training thread's niceness. Where a core is free it changes nothing."""


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether every value of `t` is finite, as a bool tensor on `t`'s device (no sync on CUDA).
    On the CPU first as one pass without a temporary (a sum is finite when every term is), then,
    only when the sum is not, exactly: `isfinite` over the elements costs 30 times the sum on one
    core (2.1 against 0.07 ms for 700k floats), which made it 3/4 of an asynchronous save's time
    on the training thread (`dsnd bench checkpoint`)."""
    if t.device.type == "cpu":
        total = torch.isfinite(t.sum())
        if bool(total):
            return total
    return torch.isfinite(t).all()


class HostCopies:
    """`full_state`'s `to_host` for an asynchronous save: each full tensor copied to host memory
    that nothing else writes: on CUDA a pinned buffer filled by a non-blocking copy (complete
    once `ready`'s event is waited for), on the CPU a clone (at ZeRO-0 the full state is the live
    parameters and optimizer state, which the next step changes under the writer). Only the rank
    that writes (`keep`) copies; every rank notes whether each value is finite, on the value's
    own device and without waiting for it (`finite`, a bool tensor on `device`)."""

    def __init__(self, device: torch.device, keep: bool) -> None:
        self.device, self.keep = device, keep
        self.finite = torch.ones((), dtype=torch.bool, device=device)

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        self.finite &= finite_flag(full).to(self.device, non_blocking=True)
        if not self.keep:
            return full
        if full.device.type != "cuda":
            return full.clone(memory_format=torch.contiguous_format)
        host = torch.empty(full.shape, dtype=full.dtype, device="cpu", pin_memory=True)
        host.copy_(full, non_blocking=True)
        return host

    def ready(self) -> Callable[[], None]:
        """What the writer calls before it reads the copies: waits for the copies issued so far
        (an event on the current CUDA stream; nothing to wait for on the CPU)."""
        if self.device.type != "cuda":
            return lambda: None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event.synchronize


@dataclass
class Job:
    """One save's work on this rank's writer thread, and (once joined) how it went."""

    name: str  # step_N
    tmp: str  # <root>/.tmp-step_N
    root: str
    write: Callable[[], object]  # this rank's files (no torch.distributed call)
    commit: Callable[[], str] | None = None  # rank 0: manifest, rename, latest, prune
    error: OSError | None = None  # this rank's own failure (a peer's is its own to report)
    final: str | None = None  # rank 0: the committed directory


def _failure(e: Exception) -> OSError:
    """`e` as the OSError `dsnd.checkpoint.failure` reports (an unexpected error, kept as the
    cause, is reported all the same rather than lost in a thread)."""
    if isinstance(e, OSError):
        return e
    error = OSError(errno.EIO, f"{type(e).__name__}: {e}")
    error.__cause__ = e
    return error


def _mark(tmp: str, rank: int, error: OSError | None) -> None:
    """This rank's marker in `tmp`: written, or failed with the reason (an empty marker when even
    the reason does not fit on the disk, so that rank 0 still stops waiting)."""
    if error is None:
        write_atomic(os.path.join(tmp, f"{WRITTEN}{rank}"), b"")
        return
    path = os.path.join(tmp, f"{FAILED}{rank}")
    try:
        write_atomic(path, str(error).encode())
    except OSError:
        with contextlib.suppress(OSError), open(path, "wb"):
            pass


def wait_for_markers(tmp: str, world: int, timeout_s: float) -> tuple[list[int], list[int]]:
    """(ranks whose write failed, ranks with no marker yet): polls `tmp` until every rank of
    `world` left a marker, one failed, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = set(os.listdir(tmp))
        failed = [r for r in range(world) if f"{FAILED}{r}" in names]
        missing = [r for r in range(world) if f"{WRITTEN}{r}" not in names and r not in failed]
        if failed or not missing or time.monotonic() >= deadline:
            return failed, missing
        time.sleep(POLL_S)


class AsyncWriter:
    """This rank's writer thread: one `Job` in flight at most (`start`, then `wait`)."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._job: Job | None = None
        self._thread: threading.Thread | None = None

    def start(self, job: Job) -> None:
        if self._thread is not None:
            raise RuntimeError(f"checkpoint {self._job and self._job.name} is still in flight")
        self._job = job
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"dsnd-save-{job.name}", daemon=True
        )
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether the writer thread is still at work (`wait` joins it either way)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Job | None:
        """The job in flight, once its thread has finished; None when none was started since
        the last wait. No collective: the caller agrees on the outcome."""
        thread, job = self._thread, self._job
        if thread is None:
            return None
        thread.join()
        self._thread = self._job = None
        return job

    def _run(self, job: Job) -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            try:
                job.write()
            except Exception as e:
                job.error = _failure(e)
            _mark(job.tmp, self.rank, job.error)
            if job.commit is not None and job.error is None:
                self._commit(job)
        except Exception as e:  # a marker the disk refused, or a commit that failed
            job.error = job.error or _failure(e)

    def _commit(self, job: Job) -> None:
        """Rank 0: commit once every rank's marker says written (a peer that failed reports
        its own error when the ranks agree; one that never answered is this rank's)."""
        failed, missing = wait_for_markers(job.tmp, self.world, self.timeout_s)
        if failed:
            return
        if missing:
            raise OSError(
                errno.ETIMEDOUT,
                f"rank {missing[0]} did not finish writing its files within {self.timeout_s:g} s",
                job.tmp,
            )
        for r in range(self.world):
            os.remove(os.path.join(job.tmp, f"{WRITTEN}{r}"))
        job.final = job.commit()
        log.info("checkpoint %s committed", job.final)
