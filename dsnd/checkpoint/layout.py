"""What a dsnd checkpoint looks like on disk, and how to find and verify one (pure file logic).

    <root>/latest                      text: the name of the newest committed step directory
    <root>/step_00000010/              one committed checkpoint
        manifest.json                  topology, step, samples, layer->stage map, versions,
                                       config, corpus, trainer state, SHA-256 of every file
        manifest.sha256                SHA-256 of manifest.json (so the manifest is checked too)
        layer_003-model.safetensors    full (unsharded) fp32 tensors of global layer 3, by name
        layer_003-optim.safetensors    its optimizer state (exp_avg, exp_avg_sq), by name
        rng/rank_00002.json            RNG states of global rank 2 (torch, Python, numpy)
    <root>/.tmp-step_00000012/         a save in progress (or crashed): never loaded, removed
                                       at the next start

No absolute paths are stored, so a checkpoint can be moved. Tensors are stored whole and by
parameter name (the global layer index is in the name), so any layout can load any checkpoint.
Nothing is pickled: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from dsnd.errors import UserError

FORMAT = "dsnd-checkpoint/1"
LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, incomplete, or failing its checksums)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def model_file(layer: int) -> str:
    return f"layer_{layer:03d}-model.safetensors"


def optim_file(layer: int) -> str:
    return f"layer_{layer:03d}-optim.safetensors"


def rng_file(rank: int) -> str:
    return f"rng/rank_{rank:05d}.json"


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_of(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def committed(root: str) -> list[str]:
    """Committed step directories under `root`, newest first (temporary ones never count)."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root)
             if step_of(n) is not None and os.path.isdir(os.path.join(root, n))]  # fmt: skip
    return [os.path.join(root, n) for n in sorted(names, key=step_of, reverse=True)]


def is_step_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest(root: str) -> str | None:
    """The step directory `root/latest` names, or None when there is no `latest`."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    name = _read_text(pointer).removesuffix("\n")
    if step_of(name) is None:
        raise CheckpointError(f"{pointer}: does not name a step directory: {name[:80]!r}")
    return os.path.join(root, name)


def _read_text(path: str) -> str:
    """A small text file; damaged bytes come back as U+FFFD instead of raising."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Problem:
    file: str  # path relative to the step directory
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def read_manifest(step_dir: str) -> dict:
    """The manifest of `step_dir`, checked against manifest.sha256; CheckpointError if not."""
    problems = _manifest_problems(step_dir)
    if problems:
        raise CheckpointError(f"{step_dir}: {problems[0]}")
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def _manifest_problems(step_dir: str) -> list[Problem]:
    path, sum_path = os.path.join(step_dir, MANIFEST), os.path.join(step_dir, MANIFEST_SUM)
    for name, p in ((MANIFEST, path), (MANIFEST_SUM, sum_path)):
        if not os.path.isfile(p):
            return [Problem(name, "missing (not a committed dsnd checkpoint)")]
    want = _read_text(sum_path)
    have = sha256_file(path)
    if want != have + "\n":  # exactly what commit.write_manifest writes
        return [Problem(MANIFEST, f"SHA-256 {have[:16]}... does not match manifest.sha256 "
                                  f"{want[:16]!r}... (one of the two is damaged)")]  # fmt: skip
    try:
        manifest = json.loads(_read_text(path))
    except ValueError as e:
        return [Problem(MANIFEST, f"not valid JSON ({e})")]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        return [Problem(MANIFEST, f"format {found!r}, expected {FORMAT!r}")]
    if not isinstance(manifest.get("files"), dict):
        return [Problem(MANIFEST, "has no 'files' table")]
    return []


def verify(step_dir: str) -> list[Problem]:
    """Every problem of `step_dir`: the manifest's own checksum, then each listed file's size
    and SHA-256. An empty list means the checkpoint is intact."""
    problems = _manifest_problems(step_dir)
    if problems:
        return problems
    with open(os.path.join(step_dir, MANIFEST), encoding="utf-8") as f:
        files = json.load(f)["files"]
    for rel, meta in sorted(files.items()):
        path = os.path.join(step_dir, rel)
        if os.path.isabs(rel) or ".." in rel.split("/"):
            problems.append(Problem(rel, "lies outside the step directory"))
        elif not os.path.isfile(path):
            problems.append(Problem(rel, "missing"))
        elif os.path.getsize(path) != meta["bytes"]:
            problems.append(Problem(rel, f"{os.path.getsize(path)} bytes, the manifest says "
                                         f"{meta['bytes']}"))  # fmt: skip
        elif sha256_file(path) != meta["sha256"]:
            problems.append(Problem(rel, "SHA-256 does not match the manifest (corrupt)"))
    return problems


def resolve_step_dir(path: str) -> str:
    """A checkpoint root (meaning its `latest`) or a step directory -> the step directory."""
    if is_step_dir(path):
        return path
    if step_of(os.path.basename(os.path.normpath(path))) is not None:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    found = latest(path)
    if found is None:
        raise CheckpointError(f"{path}: neither a step directory nor a root with '{LATEST}'")
    if not os.path.isdir(found):
        raise CheckpointError(f"{path}/{LATEST} names {os.path.basename(found)}, which is missing")
    return found


def check_intact(step_dir: str) -> None:
    """CheckpointError naming the first bad file unless `step_dir` verifies."""
    problems = verify(step_dir)
    if problems:
        raise CheckpointError(f"{os.path.join(step_dir, problems[0].file)}: {problems[0].what}")


def newest_intact(root: str, warn) -> str | None:
    """The newest committed checkpoint under `root` that verifies (`latest` first), skipping
    corrupt ones with `warn(message)`; None when there is none."""
    candidates: list[str] = []
    try:
        pointed = latest(root)
    except CheckpointError as e:
        warn(f"{e}; looking at the step directories instead")
        pointed = None
    if pointed is not None and os.path.isdir(pointed):
        candidates.append(pointed)
    candidates += [d for d in committed(root) if d not in candidates]
    for step_dir in candidates:
        problems = verify(step_dir)
        if not problems:
            return step_dir
        warn(f"skipping checkpoint {step_dir}: {problems[0]}")
    return None


def files_under(step_dir: str, names: Iterable[str]) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} for files of `step_dir` (for the manifest)."""
    out = {}
    for rel in names:
        path = os.path.join(step_dir, rel)
        out[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return out
