"""Whether a checkpoint can be trusted: its manifest, every file it lists, the tensors in them.

A load reads only `member`s (`dsnd.checkpoint.members`), files the checksums cover. `verify` lists
every problem (for `dsnd ckpt verify`), `check_intact` raises the first, `newest_intact` is what
`checkpoint.resume: auto` takes. Every refusal is one line "<step_dir>/<file>: <what>".
"""

from __future__ import annotations

import json
import os

from dsnd.checkpoint.contents import tensor_problems
from dsnd.checkpoint.files import (
    FORMAT,
    MANIFEST,
    MANIFEST_SUM,
    MODEL_SUFFIX,
    TMP_PREFIX,
    CheckpointError,
    committed,
    latest,
    optim_file_of,
    read_text,
    regular,
    sha256_file,
    step_of,
)
from dsnd.checkpoint.members import Problem, member_problem, name_problem, raise_problem
from dsnd.checkpoint.schema import STEP, file_entry_problem, manifest_problems, value_problem


def read_manifest(step_dir: str) -> dict:
    """The manifest of `step_dir`, checked against manifest.sha256 and for every key a load
    reads; CheckpointError naming the first problem if not."""
    manifest, problems = _checked_manifest(step_dir)
    if problems:
        raise_problem(step_dir, problems[0])
    return manifest


def _checked_manifest(step_dir: str) -> tuple[dict, list[Problem]]:
    """(manifest, problems). Without an intact manifest nothing else can be read: ({}, [why]).
    Else each missing or mistyped key (named by manifest.json) and files entry (named by its
    file)."""
    path, sum_path = os.path.join(step_dir, MANIFEST), os.path.join(step_dir, MANIFEST_SUM)
    for name, p in ((MANIFEST, path), (MANIFEST_SUM, sum_path)):
        if not os.path.lexists(p):
            return {}, [Problem(name, "missing (not a committed dsnd checkpoint)")]
        if not regular(p):
            return {}, [Problem(name, "is not a regular file")]
    want = read_text(sum_path)
    have = sha256_file(path)
    if want != have + "\n":  # exactly what commit.write_manifest writes
        return {}, [
            Problem(
                MANIFEST,
                f"SHA-256 {have[:16]}... does not match manifest.sha256 "
                f"{want[:16]!r}... (one of the two is damaged)",
            )
        ]
    try:
        manifest = json.loads(read_text(path))
    except ValueError as e:
        return {}, [Problem(MANIFEST, f"not valid JSON ({e})")]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        return {}, [Problem(MANIFEST, f"format {found!r}, expected {FORMAT!r}")]
    if not isinstance(manifest.get("files"), dict):
        return {}, [Problem(MANIFEST, "has no 'files' table")]
    problems = [Problem(MANIFEST, what) for what in manifest_problems(manifest)]
    for rel, meta in sorted(manifest["files"].items()):
        what = file_entry_problem(meta)
        if what:
            problems.append(Problem(rel, what))
    return manifest, problems


def _file_problem(step_dir: str, files: dict, rel: str) -> str | None:
    """What is wrong with one listed file: where it lies, its size, its SHA-256."""
    what = member_problem(step_dir, files, rel)
    if what:
        return what
    path, want = os.path.join(step_dir, rel), files[rel]["bytes"]
    size = os.path.getsize(path)
    if size != want:
        return f"{size} bytes, the manifest says {want}"
    if sha256_file(path) != files[rel]["sha256"]:
        return "SHA-256 does not match the manifest (corrupt)"
    return None


def _reference_problems(manifest: dict) -> list[Problem]:
    """The files params name, and the optimizer file beside each when there is optimizer state:
    inside the step directory and listed, so that a load never reads a byte no checksum
    covers."""
    files, keys = manifest["files"], manifest["optim_keys"]
    first_param: dict[str, str] = {}
    for name, meta in sorted(manifest["params"].items()):
        first_param.setdefault(meta["file"], name)
    problems = []
    for rel, name in sorted(first_param.items()):
        what, optim = name_problem(rel, files), optim_file_of(rel)
        if what:
            problems.append(Problem(rel, f"{what}; params['{name}'] names it"))
        elif keys and optim is None:
            problems.append(
                Problem(rel, f"is not named *{MODEL_SUFFIX}, so it has no optimizer file beside it")
            )
        elif keys and optim not in files:
            problems.append(
                Problem(
                    optim,
                    f"is not listed in {MANIFEST}'s files (it holds the optimizer state of {rel})",
                )
            )
    return problems


def _step_problem(step_dir: str, manifest: dict) -> list[Problem]:
    """A manifest `step` other than its directory's name: `latest`, `auto` and rotation go by the
    name, a resume by the manifest, so it would continue one step off (a hand edit, or a
    directory renamed)."""
    name = os.path.basename(os.path.normpath(step_dir)).removeprefix(TMP_PREFIX)
    named, step = step_of(name), manifest.get("step")
    if named is None or value_problem(step, STEP) or step == named:  # or refused as it is
        return []
    return [
        Problem(
            MANIFEST,
            f"'step' is {step}, but the directory is named {name} (a resume "
            "would continue one step off)",
        )
    ]


def verify(step_dir: str) -> list[Problem]:
    """Every problem of `step_dir`: the manifest (its checksum, then every key a load reads),
    each listed file (inside the step directory, size, SHA-256), the files params name, then the
    tensors (safetensors headers against the manifest, finite values: one more read of each
    tensor file). An empty list means the checkpoint is intact."""
    manifest, problems = _checked_manifest(step_dir)
    if not manifest:
        return problems
    files, named = manifest["files"], {p.file for p in problems}
    problems = _step_problem(step_dir, manifest) + problems
    intact = []
    for rel in sorted(set(files) - named):
        what = _file_problem(step_dir, files, rel)
        if what:
            problems.append(Problem(rel, what))
        else:
            intact.append(rel)
    if MANIFEST in named:
        return problems  # params or optim_keys unusable: nothing to check tensors against
    problems += _reference_problems(manifest)
    return problems + tensor_problems(step_dir, manifest, intact)


def check_intact(step_dir: str) -> None:
    """CheckpointError naming the first bad file unless `step_dir` verifies."""
    problems = verify(step_dir)
    if problems:
        raise_problem(step_dir, problems[0])


def newest_intact(root: str, warn) -> str | None:
    """The newest committed checkpoint under `root` that verifies (`latest` first), skipping
    corrupt ones with `warn(message)`; None when there is none."""
    candidates: list[str] = []
    try:
        pointed = latest(root)
    except CheckpointError as e:
        warn(f"{e}; looking at the step directories instead")
        pointed = None
    if pointed is not None and os.path.islink(pointed):
        warn(f"skipping checkpoint {pointed}: is a symbolic link")
    elif pointed is not None and os.path.isdir(pointed):
        candidates.append(pointed)
    candidates += [d for d in committed(root) if d not in candidates]
    for step_dir in candidates:
        problems = verify(step_dir)
        if not problems:
            return step_dir
        warn(f"skipping checkpoint {step_dir}: {problems[0]}")
    return None
