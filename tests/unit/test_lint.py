"""The linter and the formatter are part of the suite: `ruff check` and `ruff format --check` over
the package, tests and launch scripts. The formatter's word is final: no marker that turns it
off for a line or a block is allowed, so no line is laid out by hand against it. (ruff is pinned in
setup.cfg: another version formats differently.)"""

import pathlib
import subprocess
import sys

from tests.procs import ROOT as ROOT_DIR

ROOT = pathlib.Path(ROOT_DIR)


def test_ruff_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "dsnd", "tests", "launch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean_and_unmarked():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "dsnd", "tests", "launch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    marker = "fmt: " + "skip"  # (spelled apart, so this file is not a hit)
    marked = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("dsnd", "tests", "launch")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker in line or "fmt: " + "off" in line
    ]
    assert marked == []


def test_the_suite_collects_the_multi_rank_tests():
    """The parity tests live in tests/distributed (pytest's default skips folders named "dist",
    where they once were)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q"], cwd=ROOT, capture_output=True, text=True
    )
    assert "tests/distributed/test_parity_pipeline.py::" in proc.stdout, proc.stdout[-2000:]
    assert "tests/distributed/test_parity_dp.py::" in proc.stdout, proc.stdout[-2000:]
