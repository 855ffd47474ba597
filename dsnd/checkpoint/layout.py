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

A load reads only `member`s: regular files inside the step directory (no symbolic links, no
`..`) that manifest["files"] lists, so the checksums cover every byte it reads. The root is
checked before a run starts (`check_root`): a save at the end of a long run must not be the
first to find that `latest` is a directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from dsnd.checkpoint.schema import file_entry_problem, manifest_problems
from dsnd.errors import UserError

FORMAT = "dsnd-checkpoint/1"
LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
TMP_PREFIX = ".tmp-"
MODEL_SUFFIX = "-model.safetensors"
OPTIM_SUFFIX = "-optim.safetensors"
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, incomplete, or failing its checksums)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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
    names = [n for n in os.listdir(root)
             if step_of(n) is not None and _real_dir(os.path.join(root, n))]  # fmt: skip
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
    if os.path.lexists(pointer) and not _regular(pointer):
        raise CheckpointError(f"{pointer}: is not a regular file (a save writes the newest "
                              "step's name there); remove it")  # fmt: skip
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if step_of(name.removeprefix(TMP_PREFIX)) is not None and not _real_dir(path):
            what = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise CheckpointError(f"{path}: is {what}; dsnd writes step directories itself "
                                  "(move it away)")  # fmt: skip


def _regular(path: str) -> bool:
    """A regular file itself (not a symbolic link, directory or device)."""
    return stat.S_ISREG(os.lstat(path).st_mode)


def is_step_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest(root: str) -> str | None:
    """The step directory `root/latest` names, or None when there is no `latest`."""
    pointer = os.path.join(root, LATEST)
    if not os.path.lexists(pointer):
        return None
    if not _regular(pointer):
        raise CheckpointError(f"{pointer}: is not a regular file")
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

    def __post_init__(self) -> None:
        # names come from the files themselves: one with a newline must not split the line
        object.__setattr__(self, "file", printable(self.file))
        object.__setattr__(self, "what", printable(self.what))

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def printable(text: str) -> str:
    """`text` with control characters escaped as Python would (\\n, \\x1b)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def read_manifest(step_dir: str) -> dict:
    """The manifest of `step_dir`, checked against manifest.sha256 and for every key a load
    reads; CheckpointError naming the first problem if not."""
    manifest, problems = _checked_manifest(step_dir)
    if problems:
        raise_problem(step_dir, problems[0])
    return manifest


def raise_problem(step_dir: str, problem: Problem) -> None:
    """CheckpointError "<step_dir>/<file>: <what>", the one form every refusal takes."""
    raise CheckpointError(f"{os.path.join(step_dir, problem.file)}: {problem.what}")


def _checked_manifest(step_dir: str) -> tuple[dict, list[Problem]]:
    """(manifest, problems). Without an intact manifest nothing else can be read: ({}, [why]).
    Else each missing or mistyped key (named by manifest.json) and files entry (named by its
    file)."""
    path, sum_path = os.path.join(step_dir, MANIFEST), os.path.join(step_dir, MANIFEST_SUM)
    for name, p in ((MANIFEST, path), (MANIFEST_SUM, sum_path)):
        if not os.path.lexists(p):
            return {}, [Problem(name, "missing (not a committed dsnd checkpoint)")]
        if not _regular(p):
            return {}, [Problem(name, "is not a regular file")]
    want = _read_text(sum_path)
    have = sha256_file(path)
    if want != have + "\n":  # exactly what commit.write_manifest writes
        return {}, [Problem(MANIFEST, f"SHA-256 {have[:16]}... does not match manifest.sha256 "
                                      f"{want[:16]!r}... (one of the two is damaged)")]  # fmt: skip
    try:
        manifest = json.loads(_read_text(path))
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


def _name_problem(rel: str, files: dict) -> str | None:
    """Why a load may not read `rel` whatever is on disk: outside, or no checksum covers it."""
    if os.path.isabs(rel) or ".." in rel.split("/"):
        return "lies outside the step directory"
    if rel == "." or not rel.isprintable() or os.path.normpath(rel) != rel:
        return "is not a plain relative path"  # ".", "a/./b", a NUL byte: no file a save writes
    if rel not in files:
        return f"is not listed in {MANIFEST}'s files, so no checksum covers it"
    return None


def member_problem(step_dir: str, files: dict, rel: str) -> str | None:
    """Why `rel` is not a file a load may read (None when it is): it must be a regular file
    inside `step_dir`, reached without symbolic links, and listed in the manifest's `files`."""
    what = _name_problem(rel, files)
    if what:
        return what
    path = os.path.join(step_dir, rel)
    if os.path.islink(path):
        return "is a symbolic link (a checkpoint holds regular files only)"
    if not os.path.lexists(path):
        return "missing"
    if os.path.realpath(path) != os.path.join(os.path.realpath(step_dir), rel):
        return "lies outside the step directory (through a symbolic link)"
    if not os.path.isfile(path):
        return "is not a regular file"
    return None


def member(step_dir: str, manifest: dict, rel: str) -> str:
    """The path of `rel` in `step_dir`, the only way a load opens a checkpoint file;
    CheckpointError naming it unless `member_problem` finds nothing."""
    what = member_problem(step_dir, manifest["files"], rel)
    if what:
        raise_problem(step_dir, Problem(rel, what))
    return os.path.join(step_dir, rel)


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
        what, optim = _name_problem(rel, files), optim_file_of(rel)
        if what:
            problems.append(Problem(rel, f"{what}; params['{name}'] names it"))
        elif keys and optim is None:
            problems.append(Problem(rel, f"is not named *{MODEL_SUFFIX}, so it has no "
                                         "optimizer file beside it"))  # fmt: skip
        elif keys and optim not in files:
            problems.append(Problem(optim, f"is not listed in {MANIFEST}'s files (it holds the "
                                           f"optimizer state of {rel})"))  # fmt: skip
    return problems


def verify(step_dir: str) -> list[Problem]:
    """Every problem of `step_dir`: the manifest (its checksum, then every key a load reads),
    each listed file (inside the step directory, size, SHA-256), the files params name, then the
    tensors (safetensors headers against the manifest, finite values: one more read of each
    tensor file). An empty list means the checkpoint is intact."""
    manifest, problems = _checked_manifest(step_dir)
    if not manifest:
        return problems
    files, named = manifest["files"], {p.file for p in problems}
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
    from dsnd.checkpoint.contents import tensor_problems  # torch: only past the cheap checks

    return problems + tensor_problems(step_dir, manifest, intact)


def _refuse_link(step_dir: str) -> None:
    if os.path.islink(os.path.normpath(step_dir)):
        raise CheckpointError(f"{step_dir}: is a symbolic link; give the step directory itself "
                              "(a load reads only real directories)")  # fmt: skip


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


def files_under(step_dir: str, names: Iterable[str]) -> dict[str, dict]:
    """{relative name: {"bytes", "sha256"}} for files of `step_dir` (for the manifest)."""
    out = {}
    for rel in names:
        path = os.path.join(step_dir, rel)
        out[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return out
