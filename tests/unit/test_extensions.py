"""Per-environment DeepSpeed op builds: the directory choice (pure) and the build log."""

from __future__ import annotations

import importlib
import logging
import os

from dsnd.cli import main
from dsnd.engine.compat import build_estimate, log_op_builds, logged_jit_load
from dsnd.extensions import VARIABLE, _creatable, extensions_dir, use_environment_dir

HOME = {"HOME": "/home/u"}


def test_a_directory_the_user_chose_is_kept():
    assert extensions_dir({VARIABLE: "/mine", **HOME}, "/venv", True) is None
    env = {VARIABLE: "/mine"}
    assert use_environment_dir(env) is None and env == {VARIABLE: "/mine"}


def test_under_the_environment_when_it_is_writable():
    inside = "/venv/var/dsnd/torch_extensions"
    assert extensions_dir(HOME, "/venv", True) == inside
    assert extensions_dir({VARIABLE: "", **HOME}, "/venv", True) == inside  # empty: not a choice


def test_else_in_the_user_cache_one_directory_per_environment():
    a = extensions_dir(HOME, "/opt/env-a", False)
    assert a is not None and os.path.dirname(a) == "/home/u/.cache/dsnd/torch_extensions"
    assert a == extensions_dir(HOME, "/opt/env-a", False)  # every rank computes the same
    assert a != extensions_dir(HOME, "/opt/env-b", False)
    xdg = extensions_dir({"XDG_CACHE_HOME": "/c", **HOME}, "/opt/env-a", False)
    assert xdg == f"/c/dsnd/torch_extensions/{os.path.basename(a)}"


def test_creatable_creates_nothing(tmp_path):
    assert _creatable(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    assert not _creatable(str(tmp_path / "file" / "b"))


def test_cli_main_sets_it_before_any_command_runs(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, "x")  # restored (to unset) after the test
    monkeypatch.delenv(VARIABLE)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["data", "prepare", str(tmp_path / "missing.txt"), str(tmp_path / "o.bin")]) == 2
    assert os.environ[VARIABLE] == use_environment_dir({"HOME": str(tmp_path)})


class FakeBuilder:
    """Stands in for a DeepSpeed op builder: `jit_load` writes the op's library the way torch's
    ninja build does (NAME.so in the build directory) when `builds` says so."""

    name = "dsnd_fake_op"

    def __init__(self) -> None:
        self.builds = True
        self.built = 0

    def jit_load(self, verbose: bool = True) -> str:
        from torch.utils.cpp_extension import _get_build_directory

        if self.builds:
            path = os.path.join(_get_build_directory(self.name, verbose=False), f"{self.name}.so")
            with open(path, "w") as f:
                f.write("library")
            self.built += 1  # a distinct mtime per build, whatever the filesystem's resolution
            os.utime(path, (self.built, self.built))
        return "module"


def _infos(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    caplog.clear()
    return lines


def test_a_build_is_logged_before_and_after_and_a_load_is_quiet(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(VARIABLE, str(tmp_path))
    monkeypatch.setattr(FakeBuilder, "jit_load", logged_jit_load(FakeBuilder.jit_load))
    builder, build_dir = FakeBuilder(), str(tmp_path / FakeBuilder.name)
    caplog.set_level(logging.DEBUG, logger="dsnd.engine.compat")
    assert builder.jit_load(verbose=False) == "module"
    assert _infos(caplog) == [
        f"building DeepSpeed op dsnd_fake_op (first run only, about a minute) in {build_dir} ...",
        "built DeepSpeed op dsnd_fake_op in 0 s",
    ]
    builder.builds = False  # built before: torch's ninja has nothing to do
    assert builder.jit_load() == "module"
    assert _infos(caplog) == []
    builder.builds = True  # sources changed: ninja rebuilds the library in place
    builder.jit_load()
    assert _infos(caplog) == [
        f"rebuilt DeepSpeed op dsnd_fake_op in 0 s (its sources or flags changed; cached in "
        f"{build_dir})"
    ]
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()  # a build killed midway left it
    builder.builds = False
    builder.jit_load()
    assert _infos(caplog) == [
        f"waiting for {lock}: another process is building DeepSpeed op dsnd_fake_op (a build "
        "killed midway leaves the lock behind: delete it if none is running)"
    ]
    # the first run of two ranks: the other one builds, this one waits, and says so only
    os.remove(os.path.join(build_dir, "dsnd_fake_op.so"))
    builder.builds = True
    builder.jit_load()
    assert _infos(caplog) == [
        f"waiting for {lock}: another process is building DeepSpeed op dsnd_fake_op (first run "
        "only, about a minute; a build killed midway leaves the lock behind: delete it if none "
        "is running)",
        "built DeepSpeed op dsnd_fake_op in 0 s",
    ]


def test_a_peer_lock_on_a_built_op_that_goes_at_once_is_not_a_wait(monkeypatch, tmp_path, caplog):
    """Every 2-rank start: one rank holds the lock for its freshness check while the other
    comes to load; that is no build and no wait worth a line."""
    import threading

    monkeypatch.setenv(VARIABLE, str(tmp_path))
    monkeypatch.setattr(FakeBuilder, "jit_load", logged_jit_load(FakeBuilder.jit_load))
    builder, build_dir = FakeBuilder(), str(tmp_path / FakeBuilder.name)
    builder.jit_load()  # built
    caplog.set_level(logging.DEBUG, logger="dsnd.engine.compat")
    caplog.clear()
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    threading.Timer(0.3, os.remove, (lock,)).start()
    builder.builds = False
    builder.jit_load()
    assert _infos(caplog) == []


def test_the_build_line_says_about_how_long_each_op_takes():
    # measured on 2 cores: the shm comm op 25-77 s, each CPU optimizer about 1 min, async_io 2.5
    assert build_estimate("deepspeed_shm_comm") == "about a minute"
    assert build_estimate("cpu_adam") == "about a minute"
    assert build_estimate("async_io") == "a few minutes"


def test_deepspeeds_shm_op_says_built_successfully_never(monkeypatch, tmp_path, capfd):
    """DeepSpeed's comm layer prints "... built successfully" on every rank at every start, a
    load or not; dsnd's build log says it once, on rank 0, and only for a build."""
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is torch

    if not os.environ.get(VARIABLE):  # the environment's built ops, as a rank would load them
        monkeypatch.setenv(VARIABLE, str(use_environment_dir({"HOME": str(tmp_path)})))
    original = getattr(ds_comm.build_shm_op, "__wrapped__", ds_comm.build_shm_op)
    monkeypatch.setattr(ds_comm, "build_shm_op", original)  # restored after the test
    log_op_builds()
    capfd.readouterr()
    assert ds_comm.build_shm_op() is not None  # the real op, loaded (or built when it is not)
    assert "built successfully" not in capfd.readouterr().out


def test_log_op_builds_wraps_deepspeeds_jit_load_once(monkeypatch):
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    # unwrapped for the test (an earlier test in this process may have started a world, which
    # wraps it) and restored after it
    original = getattr(OpBuilder.jit_load, "__wrapped__", OpBuilder.jit_load)
    monkeypatch.setattr(OpBuilder, "jit_load", original)
    log_op_builds()
    log_op_builds()
    wrapped = ShareMemCommBuilder.jit_load  # what `load` calls on a builder DeepSpeed creates
    assert getattr(wrapped, "dsnd_logged", False) and wrapped.__wrapped__ is original


def test_ops_build_refuses_an_unknown_builder_in_one_line(capsys):
    assert main(["ops", "build", "CPUAdamBuilder", "NoSuchBuilder"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NoSuchBuilder" in err[0] and "CPUAdamBuilder" in err[0]
