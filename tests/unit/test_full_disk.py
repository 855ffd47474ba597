"""Full disks and interrupted saves (issue 37), on real filesystems: a tmpfs of a few MiB
(mounted here: root only) or /dev/full, where every write is ENOSPC.

- a run whose checkpoint.dir has no room for one checkpoint is refused before start;
- a save that finds the disk full keeps the previous checkpoint, removes its temporary
  directory and says one line (`WriteFailed`, exit 1);
- a log.dir that refuses metrics.jsonl and the rank's log stops the run at the next step with
  a checkpoint and one line, no traceback;
- Ctrl-C twice while a save is under way: the save commits, then one line and exit 130.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import torch.distributed as dist

from dsnd import cli
from dsnd.checkpoint.files import latest
from dsnd.checkpoint.save import SIGINT_ENV, save_checkpoint
from dsnd.checkpoint.verify import verify
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.data.corpus import load_corpus
from dsnd.distributed.groups import run_groups
from dsnd.errors import WriteFailed
from dsnd.pipeline.runner import StageRunner
from tests.chat_data import chat_jsonl, conversations, word_tokenizer
from tests.one_rank import one_rank_world
from tests.unit.test_prestart import isolated, refused

MIB = 1 << 20


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs (a real filesystem that fills up), unmounted after the test."""
    path = tmp_path / "small"
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def one_process(monkeypatch, tmp_path):
    """`dsnd train` in this process as a world of one, on a port of its own."""
    isolated.__wrapped__(monkeypatch, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("LOCAL_RANK", "0")


def _sets(*items: str) -> list[str]:
    small = ("log.tensorboard=false", "ds.train_batch_size=2", "ds.gradient_accumulation_steps=1")
    return [a for s in (*small, *items) for a in ("--set", s)]


def test_a_run_that_cannot_save_once_is_refused_before_start(capsys, one_process, tiny_fs):
    """llama-tiny with Adam: 217,664 parameters x 12 bytes, 2.5 MiB, on 2 MiB."""
    assert refused(capsys, "train", *_sets(f"checkpoint.dir={tiny_fs}")) == (
        f"checkpoint.dir {tiny_fs}: 2.0 MiB free, but a checkpoint of this run takes about "
        "2.5 MiB (the model and optimizer): a save would fail (the only one, at the end: "
        "checkpoint.every=0, so the whole run's work lost); free space there or set "
        "checkpoint.dir to a larger filesystem"
    )
    assert os.listdir(tiny_fs) == []


def test_a_save_on_a_full_disk_keeps_the_previous_checkpoint(one_process, tiny_fs, tmp_path):
    res = resolve(load(None, ["log.tensorboard=false", f"checkpoint.dir={tiny_fs}"]), 1)
    corpus = load_corpus(None, max_bytes=10_000)
    with one_rank_world(str(tmp_path)):
        groups = run_groups(res)
        engine = StageRunner(res, groups).engine  # no step yet: the weights alone, 0.9 MiB
        first = save_checkpoint(engine, res, groups, 1, str(tiny_fs), corpus, "j")
        free = os.statvfs(tiny_fs)
        (tiny_fs / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - MIB // 2))
        with pytest.raises(WriteFailed) as e:
            save_checkpoint(engine, res, groups, 2, str(tiny_fs), corpus, "j")
        assert e.value.code == 1
        assert str(e.value).startswith(
            "checkpoint step_00000002 not saved: rank 0: No space "
            f"left on device ({tiny_fs}/.tmp-step_00000002/"
        )
        assert str(e.value).endswith("; step_00000001 stays latest")
        engine.destroy()
    assert sorted(os.listdir(tiny_fs)) == ["filler", "latest", "step_00000001"]
    assert latest(str(tiny_fs)) == first and verify(first) == []


def _chat_sets(tmp_path) -> list[str]:
    return _sets(
        f"data.path={chat_jsonl(tmp_path / 'chat.jsonl', conversations(60))}",
        "data.format=chat",
        f"data.vocab={word_tokenizer(tmp_path / 'tok')}",
        f"log.dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "train.steps=2",
        "eval.fraction=0",
    )


def test_a_full_log_dir_stops_the_run_with_a_checkpoint_in_one_line(
    capfd, caplog, one_process, tmp_path
):
    """metrics.jsonl and the rank's log on /dev/full: the first row fails, every rank stops at
    the next step and saves there; rank 0 says so in one line and exits 1. (Chat data: the
    share of its tokens that count is said at start.)"""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    os.symlink("/dev/full", run / "metrics.jsonl")
    os.symlink("/dev/full", run / "logs" / "rank_00000.log")
    caplog.set_level("INFO", logger="dsnd")
    assert cli.main(["train", *_chat_sets(tmp_path)]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    step = tmp_path / "ck" / "step_00000002"
    assert [line for line in err.splitlines() if line.startswith("dsnd: ")] == [
        f"dsnd: cannot write {run}/logs/rank_00000.log (No space left on device); this rank's "
        "log stops there",
        f"dsnd: error: log.dir {run}: cannot write the metrics of step 1 (No space left on "
        f"device); stopped, checkpoint {step} is the last saved; free space there, then "
        "relaunch to resume",
    ]
    assert latest(str(tmp_path / "ck")) == str(step) and verify(str(step)) == []
    assert any(
        r.getMessage().startswith("data: ")
        and r.getMessage().endswith(" tokens counted in the loss (45.5%)")
        for r in caplog.records
    )
    assert not dist.is_initialized()


def test_ctrl_c_twice_in_a_save_commits_it_then_ends_in_one_line(
    capfd, one_process, tmp_path, monkeypatch
):
    monkeypatch.setenv(SIGINT_ENV, "2:0")  # both presses during step 2's save
    sets = _sets(f"log.dir={tmp_path / 'run'}", "train.steps=2", "eval.fraction=0")
    assert cli.main(["train", *sets]) == 130
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("dsnd: ")] == [
        "dsnd: Ctrl-C again: stopping once the checkpoint being saved is committed",
        "dsnd: interrupted (a second Ctrl-C); the last committed checkpoint stays latest",
    ]
    root = tmp_path / "run" / "checkpoints"
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "latest",
        "step_00000002",
    ]
    assert verify(str(root / "step_00000002")) == []
