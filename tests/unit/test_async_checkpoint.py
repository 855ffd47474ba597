"""Asynchronous checkpoints (`checkpoint.async`), without processes: the marker and commit
protocol of `AsyncWriter` with two "ranks" in one process, and real saves of a real engine in a
world of one (this process):

- an asynchronous save writes the very bytes a synchronous one writes (files and manifest);
- what it saves is the state at the step, although training changes it while the writer waits;
- its writer thread makes no torch.distributed call;
- a write the disk refuses is `WriteFailed` at the join, the same message a synchronous save
  gives, the temporary directory removed and `latest` kept.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dsnd.checkpoint.async_writer import FAILED, WRITTEN, AsyncWriter, Job, finite_flag
from dsnd.checkpoint.commit import publish, temporary_dir
from dsnd.checkpoint.files import latest
from dsnd.checkpoint.save import (
    FULL_DISK_ENV,
    SLOW_ASYNC_ENV,
    Saver,
    save_checkpoint,
)
from dsnd.checkpoint.verify import verify
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.data.corpus import load_corpus
from dsnd.distributed.groups import run_groups
from dsnd.errors import WriteFailed
from dsnd.pipeline.runner import StageRunner
from tests.one_rank import one_rank_world


def _job(root, name: str, write, commit=None) -> Job:
    tmp = temporary_dir(str(root), name)
    os.makedirs(tmp, exist_ok=True)
    return Job(name, tmp, str(root), write, commit)


def _file(tmp: str, name: str, delay: float = 0.0):
    def write() -> None:
        time.sleep(delay)
        with open(os.path.join(tmp, name), "w") as f:
            f.write(name)

    return write


def test_rank_0_commits_once_every_rank_is_written_and_without_the_markers(tmp_path):
    seen = []

    def commit() -> str:
        seen.append(sorted(os.listdir(tmp)))
        return publish(str(tmp_path), tmp, "step_1")

    tmp = temporary_dir(str(tmp_path), "step_1")
    writers = [AsyncWriter(r, 2, timeout_s=30) for r in range(2)]
    zero = _job(tmp_path, "step_1", _file(tmp, "a"), commit)
    one = _job(tmp_path, "step_1", _file(tmp, "b", delay=0.3))  # the slower rank
    writers[0].start(zero)
    writers[1].start(one)
    assert writers[0].in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        writers[0].start(zero)
    time.sleep(0.15)
    assert seen == [] and os.listdir(tmp) == ["a", f"{WRITTEN}0"]  # rank 0 waits for rank 1
    done = [writers[0].wait(), writers[1].wait()]
    assert [j.error for j in done] == [None, None]
    assert seen == [["a", "b"]]  # every rank's files, no marker
    assert done[0].final == str(tmp_path / "step_1") and done[1].final is None
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_1"]
    assert writers[0].wait() is None  # nothing in flight any more


def test_nothing_is_committed_when_a_rank_fails_or_never_answers(tmp_path):
    def full() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x")

    tmp = temporary_dir(str(tmp_path), "step_2")
    writers = [AsyncWriter(r, 2, timeout_s=30) for r in range(2)]
    writers[1].start(_job(tmp_path, "step_2", full))
    writers[0].start(_job(tmp_path, "step_2", _file(tmp, "a"), lambda: "committed"))
    zero, one = writers[0].wait(), writers[1].wait()
    assert zero.error is None and zero.final is None  # the failed rank reports its own error
    assert one.error.errno == errno.ENOSPC
    with open(os.path.join(tmp, f"{FAILED}1")) as f:
        assert "No space left on device" in f.read()

    alone = AsyncWriter(0, 2, timeout_s=0.2)  # rank 1 never writes its marker
    alone.start(_job(tmp_path, "step_3", lambda: None, lambda: "committed"))
    job = alone.wait()
    assert job.final is None and job.error.errno == errno.ETIMEDOUT
    assert "rank 1 did not finish writing its files within 0.2 s" in str(job.error)


def test_finite_flag_is_exact_even_where_the_sum_overflows():
    big = torch.full((4,), 3e38, device="cpu")
    assert bool(finite_flag(big))  # its sum is inf; every value is finite
    assert not bool(finite_flag(torch.tensor([1.0, float("nan")], device="cpu")))
    assert not bool(finite_flag(torch.tensor([float("inf"), 1.0], device="cpu")))


@pytest.fixture
def engine_world(tmp_path, monkeypatch):
    """A world of this process alone with llama-tiny's engine, its run asynchronous."""
    monkeypatch.delenv(SLOW_ASYNC_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it
    sets = ["log.tensorboard=false", "checkpoint.async=true", f"log.dir={tmp_path / 'run'}"]
    res = resolve(load(None, sets), 1)
    corpus = load_corpus(None, max_bytes=10_000)
    with one_rank_world(str(tmp_path)):
        groups = run_groups(res)
        engine = StageRunner(res, groups).engine
        try:
            yield res, groups, engine, corpus
        finally:
            engine.destroy()


def _tree(step_dir: str) -> dict[str, bytes]:
    out = {}
    for folder, _, files in os.walk(step_dir):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), step_dir)] = f.read()
    return out


def _no_collectives_off_the_main_thread(monkeypatch) -> list[str]:
    """Every torch.distributed function called from another thread, noted (and failing)."""
    calls: list[str] = []
    for name in dir(dist):
        fn = getattr(dist, name)
        if not callable(fn) or name.startswith("_") or isinstance(fn, type):
            continue

        def guard(*a, _fn=fn, _name=name, **k):
            if threading.current_thread() is not threading.main_thread():
                calls.append(_name)
                raise AssertionError(f"torch.distributed.{_name} on a writer thread")
            return _fn(*a, **k)

        monkeypatch.setattr(dist, name, guard)
    return calls


def test_an_async_save_writes_the_sync_bytes_of_the_state_at_its_step(
    engine_world, tmp_path, monkeypatch
):
    res, groups, engine, corpus = engine_world
    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    synced = save_checkpoint(engine, res, groups, 1, sync_root, corpus, "j")
    calls = _no_collectives_off_the_main_thread(monkeypatch)
    monkeypatch.setenv(SLOW_ASYNC_ENV, "0.5")  # the writer waits; training changes the state
    saver = Saver(res, groups, async_root, corpus, "j")
    assert saver.save(engine, 1) is None  # nothing committed before
    assert saver.writer.in_flight and latest(async_root) is None
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)  # a step's update (ZeRO-0: the parameters are the saved tensors)
    assert saver.finish(engine) == os.path.join(async_root, "step_00000001")
    assert calls == []
    assert latest(async_root) == os.path.join(async_root, "step_00000001")
    assert verify(latest(async_root)) == []
    assert _tree(latest(async_root)) == _tree(synced)  # the manifest too, byte for byte
    assert sorted(os.listdir(async_root)) == ["latest", "step_00000001"]


def test_a_failed_async_write_fails_at_the_join_as_a_sync_save_does(
    engine_world, tmp_path, monkeypatch
):
    res, groups, engine, corpus = engine_world
    roots = {mode: str(tmp_path / mode) for mode in ("sync", "async")}
    first = save_checkpoint(engine, res, groups, 1, roots["sync"], corpus, "j")
    monkeypatch.setenv(FULL_DISK_ENV, "2:0")
    with pytest.raises(WriteFailed) as sync_error:
        save_checkpoint(engine, res, groups, 2, roots["sync"], corpus, "j")
    saver = Saver(res, groups, roots["async"], corpus, "j")
    monkeypatch.delenv(FULL_DISK_ENV)
    saver.save(engine, 1)
    monkeypatch.setenv(FULL_DISK_ENV, "2:0")
    assert saver.save(engine, 2) == os.path.join(roots["async"], "step_00000001")
    with pytest.raises(WriteFailed) as async_error:
        saver.finish(engine)
    said = str(async_error.value).replace(roots["async"], roots["sync"])
    assert said == str(sync_error.value) and async_error.value.code == 1
    assert sorted(os.listdir(roots["async"])) == ["latest", "step_00000001"]
    assert latest(roots["async"]) == os.path.join(roots["async"], "step_00000001")
    assert latest(roots["sync"]) == first
