"""What the tensor files of a checkpoint must hold, checked against its manifest.

A model file holds exactly the parameters whose params entry names it, each in the manifest's
dtype and shape; with optimizer state, the optimizer file beside it holds exactly
`{param}.{key}` for each key of optim_keys, in the parameter's shape and a floating-point dtype.
Checksums cannot tell: a file edited on purpose, its checksum recomputed, would otherwise load
as a reinterpretation of its bytes (F32 read as I32) or fail inside the safetensors library
with a traceback. Non-finite values are refused too: a checkpoint written after the loss
diverged must never be the one `checkpoint.resume: auto` picks.
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from dsnd.checkpoint.files import MANIFEST, optim_file_of
from dsnd.checkpoint.members import Problem, member, raise_problem
from dsnd.checkpoint.safetensors_header import FLOAT_DTYPES, HeaderError, read_header
from dsnd.checkpoint.schema import expected_dtype

# tensor name -> (its dtype, None for any floating-point one; its shape)
Expected = dict[str, tuple[str | None, list[int]]]


def expected_tensors(manifest: dict) -> dict[str, Expected]:
    """{file relative to the step directory: the tensors it must hold exactly}."""
    keys = manifest["optim_keys"]
    out: dict[str, Expected] = {}
    for name, meta in manifest["params"].items():
        shape = list(meta["shape"])
        out.setdefault(meta["file"], {})[name] = (expected_dtype(meta), shape)
        optim = optim_file_of(meta["file"])
        if keys and optim is not None:
            out.setdefault(optim, {}).update({f"{name}.{k}": (None, shape) for k in keys})
    return out


def header_problem(path: str, expected: Expected) -> str | None:
    """The first way the safetensors header of `path` disagrees with `expected` (and how many
    more there are), or None."""
    try:
        header = read_header(path)
    except HeaderError as e:
        return str(e)
    wrong = [
        _tensor_problem(name, header.get(name), dtype, shape)
        for name, (dtype, shape) in sorted(expected.items())
    ]
    wrong = [w for w in wrong if w]
    wrong += [
        f"holds {name}, which {MANIFEST} does not list for it"
        for name in sorted(set(header) - set(expected))
    ]
    if not wrong:
        return None
    return wrong[0] + _and_more(len(wrong) - 1, "problem")


def _tensor_problem(
    name: str, found: tuple[str, list[int]] | None, dtype: str | None, shape: list[int]
) -> str | None:
    if found is None:
        return f"has no tensor {name}, which {MANIFEST} lists"
    have_dtype, have_shape = found
    if dtype is None and have_dtype not in FLOAT_DTYPES:
        return f"{name} is {have_dtype}, optimizer state must be floating-point"
    if dtype is not None and have_dtype != dtype:
        return f"{name} is {have_dtype}, {MANIFEST} says {dtype}"
    if have_shape != shape:
        return f"{name} has shape {have_shape}, {MANIFEST} says {shape}"
    return None


def nonfinite_problem(path: str) -> str | None:
    """'holds non-finite values: <tensor>' for the first tensor of `path` (by name) with a NaN
    or an infinity, or None. Reads every tensor once; call after `header_problem` passed."""
    bad = []
    try:
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not _finite(tensor):
                    bad.append(name)
    except SafetensorError as e:
        return f"not readable as safetensors ({e})"
    if not bad:
        return None
    return f"holds non-finite values: {bad[0]}" + _and_more(len(bad) - 1, "tensor")


def _and_more(count: int, noun: str) -> str:
    """' (and 2 more problems)': one line names the first, and says how many follow."""
    return f" (and {count} more {noun}{'s' if count > 1 else ''})" if count else ""


def _finite(tensor: torch.Tensor) -> bool:
    # torch has no isfinite for the 8-bit float types: widen those first
    wide = tensor.float() if tensor.element_size() == 1 else tensor
    return bool(torch.isfinite(wide).all())


def tensor_problems(step_dir: str, manifest: dict, intact: list[str]) -> list[Problem]:
    """For each tensor file of `intact` (listed files that passed their checksums): its header
    against the manifest, then its values."""
    expected = expected_tensors(manifest)
    problems = []
    for rel in sorted(set(expected) & set(intact)):
        path = os.path.join(step_dir, rel)
        what = header_problem(path, expected[rel]) or nonfinite_problem(path)
        if what:
            problems.append(Problem(rel, what))
    return problems


def tensor_file(step_dir: str, manifest: dict, expected: dict[str, Expected], rel: str) -> str:
    """The path of tensor file `rel` for a load: a `member` of the step directory whose header
    holds exactly what `expected` (`expected_tensors(manifest)`) says; CheckpointError naming it
    if not (a load reads headers again: the files may have changed since `verify`)."""
    path = member(step_dir, manifest, rel)
    what = header_problem(path, expected.get(rel, {}))
    if what:
        raise_problem(step_dir, Problem(rel, what))
    return path
