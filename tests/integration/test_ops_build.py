"""`dsnd ops build` for real, as README's install runs it (`.ci/run` runs it just before the
tests, so here it finds every op built and loads them: seconds; on a fresh environment it
compiles them, about 6 min on 2 cores). The unit suite tests only what it plans to build
(`ops_for`) and its stale-lock removal, never a build."""

from __future__ import annotations

import os
import subprocess
import sys

from dsnd.commands.ops import DEFAULT_BUILDERS
from dsnd.extensions import VARIABLE, use_environment_dir


def test_ops_build_leaves_every_op_dsnd_uses_built_in_the_environment_dir():
    """Each "ready" op's library is where a later rank's JIT load looks."""
    env = dict(os.environ)
    env.pop(VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-m", "dsnd", "ops", "build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert sorted(lines) == sorted(DEFAULT_BUILDERS)
    use_environment_dir(env)
    for line in lines.values():
        assert " ready (" in line or " skipped: " in line, line
        if " ready (" in line:
            op = line.split("ready (")[1].split(",")[0]
            assert os.path.isfile(os.path.join(env[VARIABLE], op, f"{op}.so")), line
