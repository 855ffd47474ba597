"""Atomic commit of a checkpoint directory (the protocol of PyTorch DCP and Orbax, on a plain
POSIX filesystem shared by every host).

1. Every rank writes its files under `<root>/.tmp-step_N/`, each through a temporary name,
   fsync and rename (`write_atomic`).
2. Rank 0 collects every rank's file list, hashes the files into the manifest, writes
   `manifest.json` and `manifest.sha256` last, fsyncs, and renames the directory to
   `<root>/step_N` (one atomic rename).
3. Only then does `latest` change (again by temporary name and rename).

A crash at any moment leaves either no `step_N` at all (a `.tmp-` directory, removed at the next
start by `remove_temporaries`) or a complete one; `latest` always names a complete one. A save
that fails without a crash (a full disk) removes its `.tmp-` directory at once
(`dsnd.checkpoint.failure`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from dsnd.checkpoint.files import (
    LATEST,
    MANIFEST,
    MANIFEST_SUM,
    TMP_PREFIX,
    committed,
    files_under,
    latest,
    sha256_file,
)
from dsnd.fs import fsync


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either absent or complete (a write that fails,
    on a full disk say, leaves no `.partial` file either)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a write's own: no file named
            raise OSError(e.errno, e.strerror, path) from e
        raise
    fsync(os.path.dirname(path) or ".")


def temporary_dir(root: str, name: str) -> str:
    return os.path.join(root, TMP_PREFIX + name)


def write_manifest(step_dir: str, manifest: dict, files: list[str]) -> None:
    """Add the size and SHA-256 of every file in `files` to `manifest`, write it, then its own
    checksum (the manifest is the last thing a save writes)."""
    manifest = dict(manifest, files=files_under(step_dir, files))
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_atomic(os.path.join(step_dir, MANIFEST), text)
    digest = sha256_file(os.path.join(step_dir, MANIFEST))
    write_atomic(os.path.join(step_dir, MANIFEST_SUM), (digest + "\n").encode())


def publish(root: str, tmp_dir: str, name: str) -> str:
    """Rename the finished `tmp_dir` to `root/name` and point `latest` at it."""
    final = os.path.join(root, name)
    if os.path.exists(final):  # a previous run's checkpoint of the same step: replace it
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    fsync(root)
    write_atomic(os.path.join(root, LATEST), (name + "\n").encode())
    return final


def remove_temporaries(root: str) -> list[str]:
    """Delete the `.tmp-` directories a crashed save left; returns what was removed."""
    if not os.path.isdir(root):
        return []
    gone = []
    for name in sorted(os.listdir(root)):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone


def prune(root: str, keep: int) -> list[str]:
    """Keep the newest `keep` committed checkpoints (0 = all) and the one `latest` names. Each
    other one is renamed away (a temporary name, removed at the next start if this one dies)
    before it is deleted: a reader such as `dsnd ckpt verify` finds it whole or gone, never
    half deleted, and can tell the two apart."""
    if keep <= 0:
        return []
    pointed = latest(root)
    removed = []
    for step_dir in committed(root)[keep:]:
        if step_dir != pointed:
            doomed = os.path.join(root, f"{TMP_PREFIX}removed-{os.path.basename(step_dir)}")
            try:
                os.rename(step_dir, doomed)
            except OSError:  # a leftover of that name: delete in place, as before
                doomed = step_dir
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(step_dir)
    return removed
