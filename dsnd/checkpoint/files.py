"""What a dsnd checkpoint looks like on disk, and how to find one (pure file logic; checking one
is `dsnd.checkpoint.verify`).

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

The root is checked before a run starts (`check_root`): a save at the end of a long run must
not be the first to find that `latest` is a directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterable

from dsnd.errors import UserError

FORMAT = "dsnd-checkpoint/1"
LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
TMP_PREFIX = ".tmp-"
MODEL_SUFFIX = "-model.safetensors"
OPTIM_SUFFIX = "-optim.safetensors"
STEP_DIGITS = 8
_STEP_DIR = re.compile(rf"step_(\d{{{STEP_DIGITS}}})")
MAX_STEP = 10**STEP_DIGITS - 1
"""The largest step a checkpoint can hold: a step directory's name has exactly STEP_DIGITS
digits (`step_of` reads no other), so `latest`, `auto` resume and verify could not find a later
one. Every writer and importer refuses a step beyond it."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, incomplete, or failing its checksums)."""


def step_dir_name(step: int) -> str:
    if not 0 <= step <= MAX_STEP:  # its name would not be read back (see MAX_STEP)
        raise ValueError(f"step {step} is outside [0, {MAX_STEP}]")
    return f"step_{step:0{STEP_DIGITS}d}"


def model_file(layer: int) -> str:
    return f"layer_{layer:03d}{MODEL_SUFFIX}"


def optim_file(layer: int) -> str:
    return f"layer_{layer:03d}{OPTIM_SUFFIX}"


def rng_file(rank: int) -> str:
    return f"rng/rank_{rank:05d}.json"


def optim_file_of(model_rel: str) -> str | None:
    """The optimizer file beside a layer's model file (None for a name that is not one)."""
    stem = model_rel.removesuffix(MODEL_SUFFIX)
    return stem + OPTIM_SUFFIX if stem != model_rel else None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def step_of(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _real_dir(path: str) -> bool:
    """A directory, not a symbolic link to one (a step directory elsewhere is not this run's)."""
    return os.path.isdir(path) and not os.path.islink(path)


def committed(root: str) -> list[str]:
    """Committed step directories under `root`, newest first (temporary ones and symbolic links
    never count)."""
    if not os.path.isdir(root):
        return []
    names = [
        n for n in os.listdir(root) if step_of(n) is not None and _real_dir(os.path.join(root, n))
    ]
    return [os.path.join(root, n) for n in sorted(names, key=step_of, reverse=True)]


def check_root(root: str) -> None:
    """CheckpointError naming the entry unless a save could write under `root` (checked before a
    run starts; a missing root is fine, the first save makes it): a directory whose `latest` is
    a regular file and whose step (and temporary step) entries are real directories."""
    if not os.path.lexists(root):
        return
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: exists and is not a directory (checkpoint.dir)")
    pointer = os.path.join(root, LATEST)
    if os.path.lexists(pointer) and not regular(pointer):
        raise CheckpointError(
            f"{pointer}: is not a regular file (a save writes the newest "
            "step's name there); remove it"
        )
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if step_of(name.removeprefix(TMP_PREFIX)) is not None and not _real_dir(path):
            what = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise CheckpointError(
                f"{path}: is {what}; dsnd writes step directories itself (move it away)"
            )


def regular(path: str) -> bool:
    """A regular file itself (not a symbolic link, directory or device)."""
    return stat.S_ISREG(os.lstat(path).st_mode)


def is_step_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest(root: str) -> str | None:
    """The step directory `root/latest` names, or None when there is no `latest`."""
    pointer = os.path.join(root, LATEST)
    if not os.path.lexists(pointer):
        return None
    if not regular(pointer):
        raise CheckpointError(f"{pointer}: is not a regular file")
    name = read_text(pointer).removesuffix("\n")
    if step_of(name) is None:
        raise CheckpointError(f"{pointer}: does not name a step directory: {name[:80]!r}")
    return os.path.join(root, name)


def read_text(path: str) -> str:
    """A small text file; damaged bytes come back as U+FFFD instead of raising."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _refuse_link(step_dir: str) -> None:
    if os.path.islink(os.path.normpath(step_dir)):
        raise CheckpointError(
            f"{step_dir}: is a symbolic link; give the step directory itself "
            "(a load reads only real directories)"
        )


def resolve_step_dir(path: str) -> str:
    """A checkpoint root (meaning its `latest`) or a step directory -> the step directory
    (never a symbolic link to one)."""
    if is_step_dir(path) or step_of(os.path.basename(os.path.normpath(path))) is not None:
        _refuse_link(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    found = latest(path)
    if found is None:
        raise CheckpointError(f"{path}: neither a step directory nor a root with '{LATEST}'")
    _refuse_link(found)
    if not os.path.isdir(found):
        raise CheckpointError(f"{path}/{LATEST} names {os.path.basename(found)}, which is missing")
    return found


def files_under(step_dir: str, names: Iterable[str]) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} for files of `step_dir` (for the manifest)."""
    out = {}
    for rel in names:
        path = os.path.join(step_dir, rel)
        out[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return out
