"""A rank notices that the launcher that started it exited (`dsnd.distributed.launcher_watch`),
on real processes shaped like DeepSpeed's one-host launch: runner -> launch.py -> rank."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys

from dsnd.distributed.launcher_watch import LauncherWatch
from dsnd.stop_request import StopRequest
from tests.procs import ROOT

# the rank: its watch, then what gone() says once it says something (or after 20 s)
RANK = """
import sys, time
from dsnd.distributed.launcher_watch import LauncherWatch
watch = LauncherWatch.start({"RANK": "0", "WORLD_SIZE": "2"})
print(watch.chain, flush=True)
deadline = time.monotonic() + 20
while watch.gone() is None and time.monotonic() < deadline:
    time.sleep(0.02)
print(watch.gone(), flush=True)
"""
# launch.py's stand-in: its command line names DeepSpeed's launcher module, as the real one's does
LAUNCH = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])"
# the runner's: starts launch.py, prints its pid, waits
RUNNER = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "deepspeed.launcher.launch"])
print(p.pid, flush=True)
p.wait()
"""


def test_the_runners_exit_is_seen_though_launch_py_lives_on():
    env = {**os.environ, "PYTHONPATH": ROOT}
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, LAUNCH, RANK], env=env, stdout=subprocess.PIPE, text=True
    )
    launch_pid = int(runner.stdout.readline())
    try:
        chain = ast.literal_eval(runner.stdout.readline())  # the rank's, via the shared stdout
        assert chain[0][1] == launch_pid and chain[1:] == [(launch_pid, runner.pid)], chain
        os.kill(runner.pid, signal.SIGTERM)  # the runner alone, as `kill PID` does
        runner.wait(timeout=10)
        said = runner.stdout.readline().strip()
        assert said == f"launcher pid {runner.pid} exited"
        assert os.path.exists(f"/proc/{launch_pid}")  # launch.py was not signalled
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        try:
            os.kill(launch_pid, signal.SIGKILL)  # the rank ends by itself (20 s at most)
        except ProcessLookupError:
            pass


def test_no_launcher_no_watch_and_a_watch_stops_like_a_signal():
    assert LauncherWatch.start({}) is None  # a world of one: `nohup dsnd train &` lives on
    watch = LauncherWatch.start({"RANK": "0", "WORLD_SIZE": "2"})
    assert watch is not None and watch.chain[0] == (os.getpid(), os.getppid())
    assert watch.gone() is None
    left = LauncherWatch([(os.getpid(), os.getppid() + 1)])  # a parent this process no longer has
    with StopRequest(left) as stop:
        assert stop.requested and stop.signal_name == f"launcher pid {os.getppid() + 1} exited"
        os.kill(os.getpid(), signal.SIGINT)  # the first signal: still only the flag
        assert stop.signal_name.startswith("launcher pid")
