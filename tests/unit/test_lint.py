"""The linter is part of the suite: `ruff check` over the package, tests and launch scripts."""

import subprocess
import sys

from tests.procs import ROOT


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "dsnd", "tests", "launch"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suite_collects_the_multi_rank_tests():
    """The parity tests live in tests/distributed (pytest's default skips folders named "dist",
    where they once were)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert "tests/distributed/test_parity_pipeline.py::" in proc.stdout, proc.stdout[-2000:]
    assert "tests/distributed/test_parity_dp.py::" in proc.stdout, proc.stdout[-2000:]
