"""Device discipline: a torch tensor factory in `dsnd/` names its device.

On CUDA a tensor made without `device=` lands on the CPU, and an NCCL collective refuses it
("No backend type associated with device type cpu"), or it is copied to the GPU on every use.
gloo takes CPU tensors, so the suite's multi-rank runs cannot see it: this test reads the code.
Every factory call (``torch.zeros(...)``, ``torch.tensor(...)``, ...) needs a ``device=``
keyword, unless it is listed below with the reason it belongs on the CPU. (``*_like`` factories
take their argument's device and are not checked.)
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dsnd"
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
}

CPU_BY_DESIGN = {
    ("bench/comm_rank.py", "layout"): "an empty scalar, asked only for its element size",
    ("bench/moe.py", "_inputs"): "drawn from a CPU generator (the same on every device), moved",
    ("bench/kernels.py", "ring_kernel_rows"): "drawn from a CPU generator, moved",
    ("bench/kernels.py", "packing_rows"): "drawn from a CPU generator, moved",
    ("cp/ring.py", "kernels_agree"): "the kernel trial's inputs: a CPU generator's, moved",
    ("checkpoint/rng.py", "restore"): "torch.set_rng_state takes a CPU byte tensor",
    ("commands/generate.py", "run_generate"): "one-process sampling on the CPU-loaded model",
    ("engine/compat.py", "replay_cpu_adam_steps"): "DeepSpeed's CPU Adam op takes CPU tensors",
    ("engine/experts.py", "_sum_over"): "wraps DeepSpeed's norm, moved to the accelerator next",
    ("engine/optimizers.py", "state_bytes"): "the optimizer trial: never touches a GPU",
    ("engine/state.py", "materialise_optimizer_state"): "torch optimizers keep `step` on the CPU",
    ("engine/state.py", "_nadam_mu_product"): "NAdam keeps mu_product on the CPU, as `step`",
    ("report/flops.py", "measured_cpu_peak"): "measures the CPU",
    ("layout_search/hardware.py", "this_cpu"): "measures the CPU",
    ("moe/capacity.py", "__init__"): "moved to the layers' device at the first forward",
    ("moe/router_load.py", "__init__"): "moved to the layers' device at the first forward",
    ("model/safetensors_stream.py", "layout"): "file layout on the writer's CPU",
    ("model/stack.py", "_initial_value"): "initial weights drawn on the CPU from (seed, layer, "
    "name), the same on every layout; the engine moves them",
    ("tp/layers.py", "__init__"): "parameters allocated on the CPU, filled by the stack's "
    "initialiser and moved by the engine",
}


def _unnamed_device_calls(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, factory) of every torch factory call without `device=`."""
    tree = ast.parse(path.read_text())
    owner: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                owner[id(sub)] = node.name  # the innermost function wins (walked last)
    found = []
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(func, ast.Attribute)
            and func.attr in FACTORIES
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append((owner.get(id(node), "<module>"), node.lineno, func.attr))
    return found


def test_every_tensor_factory_names_its_device():
    offenders, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for function, line, factory in _unnamed_device_calls(path):
            if (rel, function) in CPU_BY_DESIGN:
                used.add((rel, function))
            else:
                offenders.append(f"dsnd/{rel}:{line} torch.{factory} in {function}()")
    assert not offenders, "tensor factories without device=:\n" + "\n".join(offenders)
    assert used == set(CPU_BY_DESIGN), f"stale exceptions: {set(CPU_BY_DESIGN) - used}"


def test_the_lint_sees_a_factory_without_a_device(tmp_path):
    code = tmp_path / "x.py"
    lines = [
        "import torch",
        "def f(d):",
        "    a = torch.zeros(3)",
        "    b = torch.ones(3, device=d)",
        "    return torch.empty_like(a), b",
    ]
    code.write_text("\n".join(lines) + "\n")
    assert _unnamed_device_calls(code) == [("f", 3, "zeros")]
