"""The linter is part of the suite: `ruff check` over the package, tests and launch scripts."""

import subprocess
import sys

from tests.procs import ROOT


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "dsnd", "tests", "launch"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
