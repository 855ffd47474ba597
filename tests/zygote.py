"""Rank processes for the suite, forked from one process that has imported torch, DeepSpeed,
transformers and dsnd once (a zygote), instead of each rank importing them again.

Why: a rank spends about 7 CPU-seconds importing those (`python -X importtime -c "import
dsnd.trainer"`), and the suite starts a few hundred ranks on two cores. A forked rank is still
its own process, with its own environment (RANK, WORLD_SIZE, MASTER_PORT, ... set before its
program runs), its own gloo groups over loopback and its own exit code; only the interpreter's
start and the imports are shared. The zygote imports and never computes: no thread, no OpenMP
region, no accelerator context exists when it forks (a thread would not survive the fork).

Protocol (one line of JSON each way over a Unix socket): the test process sends
``{"argv", "env", "cwd", "log"}``, the zygote forks and answers ``{"pid"}``; when the child
ends, the zygote writes its exit code to ``<log>.rc``. `run` waits for those files, so a rank's
end is seen without being the test process's child.

What a forked rank does not have of a fresh interpreter, and why that is acceptable here:
- one string-hash seed for every rank: an order over a set of strings that differed between
  ranks would not show. The launcher tests (tests/integration) start every rank fresh, and
  ``DSND_TEST_FRESH_RANKS=1`` runs this suite's ranks fresh too (`tests.procs.run_ranks`);
- the environment as the zygote's imports read it (the first run's: the same for every run
  but RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT, which are read at run time);
- torch's classic TCPStore server (``USE_LIBUV=0``): the libuv one does not serve in a process
  forked after torch's import.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PRELOAD = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "transformers",
    "dsnd.trainer",
    # imported by every DeepSpeed engine's start (its optimizer check), with torch.compile's
    # machinery: a tenth of a rank's time in test_checkpoint_resume (py-spy, not in the suite)
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch.utils.cpp_extension",
)


class Zygote:
    """The zygote of this test session (started on first use by `zygote()`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="dsnd-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path], env=env, cwd=env["ZYGOTE_CWD"]
        )
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the rank zygote did not start")
            time.sleep(0.1)

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            s.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}).encode())
            s.shutdown(socket.SHUT_WR)
            return json.loads(s.makefile().read())["pid"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _child(request: dict) -> None:
    """In the forked child: become the rank (environment, directory, output, argv) and run its
    program as `python <argv>` would; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a kill of the rank takes what it started
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import runpy

        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what the interpreter's own exit would run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    # what the imports made never dies: a rank's garbage collections need not walk it
    # (test_parity_tp: 55-56 s with, 58-63 s without; observed, not in the suite)
    gc.freeze()
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork copies only the thread that forks
        raise RuntimeError(f"the zygote must fork with one thread, it has {len(threads)}")
    logs: dict[int, str] = {}

    def reap(*_) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            log = logs.pop(pid, None)
            if log is not None:
                with open(log + ".rc.tmp", "w") as f:
                    f.write(str(code))
                os.replace(log + ".rc.tmp", log + ".rc")

    signal.signal(signal.SIGCHLD, reap)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path + ".tmp")
    server.listen(64)
    os.replace(path + ".tmp", path)
    while True:
        try:
            conn, _ = server.accept()
        except InterruptedError:
            continue
        with conn:
            request = json.loads(conn.makefile().read())
            # a child that ends at once must find its log registered: SIGCHLD waits until then
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            pid = os.fork()
            if pid == 0:
                # the child must not hold the test process's connection open: its reader
                # waits for the end of the reply, which would then come only at the rank's end
                conn.close()
                server.close()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                _child(request)
            logs[pid] = request["log"]
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            conn.sendall(json.dumps({"pid": pid}).encode())


_ZYGOTE: Zygote | None = None


def zygote(env: dict[str, str], cwd: str) -> Zygote:
    """This session's zygote, started with `env` (the ranks' common environment) on first use."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = Zygote({**env, "ZYGOTE_CWD": cwd})
        atexit.register(_ZYGOTE.close)
    return _ZYGOTE


def run(
    world: int, argv: list[str], timeout_s: float, envs: list[dict[str, str]], cwd: str
) -> tuple[list[str], list[int | None], str | None]:
    """Fork `world` ranks of `python <argv>` with their environments; (outputs, exit codes,
    problem): the first rank to fail, or the deadline, ends the others, as
    `dsnd.launcher.local_ranks.run_ranks` does."""
    z = zygote(envs[0], cwd)
    folder = tempfile.mkdtemp(prefix="dsnd-ranks-")
    logs = [os.path.join(folder, f"rank_{r}.log") for r in range(world)]
    for log in logs:
        open(log, "w").close()
    pids = [z.fork(list(argv), envs[r], cwd, logs[r]) for r in range(world)]

    def code(r: int) -> int | None:
        try:
            with open(logs[r] + ".rc") as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    deadline, problem = time.monotonic() + timeout_s, None
    while any(code(r) is None for r in range(world)):
        if any(code(r) not in (None, 0) for r in range(world)):
            problem = "a rank failed"
            break
        if time.monotonic() > deadline:
            problem = f"timed out after {timeout_s:.0f}s"
            break
        time.sleep(0.1)
    for r, pid in enumerate(pids):
        if code(r) is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    end = time.monotonic() + 30
    while any(code(r) is None for r in range(world)) and time.monotonic() < end:
        time.sleep(0.05)
    outputs, codes = [], [code(r) for r in range(world)]
    for log in logs:
        with open(log, errors="replace") as f:
            outputs.append(f.read())
    shutil.rmtree(folder, ignore_errors=True)
    return outputs, codes, problem


if __name__ == "__main__":
    _serve(sys.argv[1])
