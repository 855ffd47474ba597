"""Imports flow one way: each part of dsnd imports only parts listed before it in LAYERS (read
from the source with `ast`, lazy imports inside functions included)."""

from __future__ import annotations

import ast
import pathlib

import dsnd

LAYERS = [
    "errors", "engine", "extensions", "secrets", "topology", "tp", "cp", "model", "plan", "config",
    "data", "distributed", "flops", "phases", "pipeline", "progress", "stop_request", "metrics",
    "telemetry", "report", "checkpoint", "trainer", "launch", "planner", "bench", "commands",
    "cli", "__main__",
]  # fmt: skip
ROOT = pathlib.Path(dsnd.__file__).parent


def _part(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).with_suffix("").parts[0]


def _imported_parts(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n.split(".")[1] for n in names if n.startswith("dsnd.")}


def test_every_part_is_placed():
    parts = {_part(p) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert parts == set(LAYERS)


def test_imports_flow_one_way():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _part(path)
        if me == "__init__":
            continue
        for other in _imported_parts(path) - {me}:
            if LAYERS.index(other) > LAYERS.index(me):
                upward.append(f"{path.relative_to(ROOT)} imports dsnd.{other}")
    assert upward == []


def test_only_the_engine_reads_deepspeed_internals():
    """`deepspeed.runtime` (and `deepspeed.utils.groups`) are imported by dsnd/engine/ only."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if _part(path) == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith(("deepspeed.runtime", "deepspeed.utils.groups")) for n in names):
                found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_engine_imports_no_other_part_of_dsnd():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        assert _imported_parts(path) <= {"engine"}, path
