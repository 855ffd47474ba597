"""Imports flow one way: each part of dsnd imports only parts listed before it in LAYERS (read
from the source with `ast`, lazy imports inside functions included)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import dsnd

LAYERS = [
    "errors",
    "fs",
    "engine",
    "extensions",
    "secrets",
    "topology_rules",
    "topology",
    "tp",
    "cp",
    "model",
    "moe",
    "plan",
    "config",
    "data",
    "distributed",
    "pipeline",
    "stop_request",
    "report",
    "checkpoint",
    "trainer",
    "launcher",
    "layout_search",
    "bench",
    "commands",
    "cli",
    "__main__",
]
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


def _imports(path: pathlib.Path) -> list[str]:
    """Every module `path` imports (lazy imports inside functions included), `from X import Y`
    as X.Y as well as X."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_only_the_engine_imports_deepspeed():
    """DeepSpeed, any module of it, is imported by dsnd/engine/ only: the one boundary a
    DeepSpeed upgrade has to read."""
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(ROOT.rglob("*.py"))
        if _part(path) != "engine"
        for name in _imports(path)
        if name == "deepspeed" or name.startswith("deepspeed.")
    ]
    assert found == []


def _module_name(path: pathlib.Path) -> str:
    parts = ("dsnd", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles():
    """No module reaches itself through the modules it imports (lazy imports included): each
    dependency is one-way inside a part as well as between parts."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    cycles, done = [], set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(" -> ".join(stack[stack.index(name) :] + [name]))
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_the_plan_config_model_and_topology_import_without_deepspeed():
    """The pure parts (the Plan, the config, the model's specs, the topology) are plain Python:
    every module of them imports with DeepSpeed made unimportable."""
    script = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['deepspeed'] = None\n"
        "import dsnd.topology\n"
        "for pkg in ('dsnd.plan', 'dsnd.config', 'dsnd.model'):\n"
        "    for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "assert sys.modules['deepspeed'] is None\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT.parent, timeout=120
    )
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr[-2000:]


DEGREES = {"pp", "dp", "tp", "cp", "ep", "dp_shard"}


def degree_reads(path: pathlib.Path) -> list[str]:
    """Where `path` reads a parallel degree from the run config: ``<x>.parallel.<degree>``, a
    degree of a name bound to ``<x>.parallel``, ``getattr(<x>.parallel, "<degree>")``, or hpZ's
    size (``zero_hpz_partition_size``) from the DeepSpeed JSON."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT) if ROOT in path.parents else path.name
    bound = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "parallel"
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def is_parallel(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "parallel") or (
            isinstance(node, ast.Name) and node.id in bound
        )

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in DEGREES and is_parallel(n.value):
            found.append(f"{where}:{n.lineno} .{n.attr}")
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "getattr"
            and n.args
            and is_parallel(n.args[0])
        ):
            found.append(f"{where}:{n.lineno} getattr")
        elif isinstance(n, ast.Constant) and n.value == "zero_hpz_partition_size":
            found.append(f"{where}:{n.lineno} zero_hpz_partition_size")
    return found


def test_no_degree_is_read_from_the_run_config_outside_config():
    """Every parallel degree is read once, into `Topology` (dsnd/config/resolve.py); everything
    else asks the topology (`res.topology.ep`) or its groups (`groups.expert`)."""
    found = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        if _part(path) != "config"
        for hit in degree_reads(path)
    ]
    assert found == []


def test_the_degree_scan_finds_each_way_of_reading_one(tmp_path):
    """The scan above is not vacuous: each form it looks for is found."""
    src = tmp_path / "probe.py"
    src.write_text(
        "par = res.run.parallel\na = par.ep\nb = res.run.parallel.dp_shard\n"
        "c = getattr(run.parallel, 'tp')\nd = zero['zero_hpz_partition_size']\n"
        "e = res.topology.ep\nf = run.parallel.schedule\n"
    )
    hits = degree_reads(src)
    assert [h.split(" ", 1)[1] for h in hits] == [
        ".ep",
        ".dp_shard",
        "getattr",
        "zero_hpz_partition_size",
    ]


PURE_OF_THE_ENGINE = [
    "topology_rules",
    "topology",
    "tp",
    "moe",
    "plan",
    "data",
    "report",
    "trainer",
    "layout_search",
]
"""Parts that take numbers, not DeepSpeed's state: the engine adapter (`dsnd.engine`, used by
the pipeline's `StageRunner`) reads it for them, so an engine swap never reaches them."""


def test_the_pure_parts_do_not_import_the_engine():
    found = [
        f"{path.relative_to(ROOT)}"
        for path in sorted(ROOT.rglob("*.py"))
        if _part(path) in PURE_OF_THE_ENGINE and "engine" in _imported_parts(path)
    ]
    assert found == []


def test_every_package_says_in_one_line_what_lives_there():
    """Each `__init__.py` opens with a docstring whose first line is a whole summary."""
    missing = []
    for path in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n", 1)[0]
        if not first or not (first.endswith(".") or doc == first or doc.split("\n")[1] == ""):
            missing.append(f"{path.relative_to(ROOT)}: {first!r}")
    assert missing == []


def test_no_function_over_60_lines_and_no_file_over_450():
    """Small files with one purpose and short functions (counted as `ruff format` lays them
    out), so a newcomer reads any one in a sitting."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        src = path.read_text()
        if src.count("\n") > 450:
            long.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {size}")
    assert long == []
