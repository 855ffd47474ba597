"""Where a transformers export is written: never over what dsnd did not write, never half done.

An export directory holds `EXPORT_MARKER`, written last: which run it came from (the run's
checkpoint root, as a real path) and step, and every file the export wrote. A target may be

- absent or an empty directory, or
- an earlier export of the same run (its marker names the same checkpoint root) holding nothing
  but the files its marker lists: it is replaced whole.

Anything else (a file, a symbolic link, a directory of other files, another run's export, or an
export with a file added since) is refused by name before training starts (`check_target`, from
`dsnd.commands.prestart`) and again when the export is written.

An export is written into a temporary sibling `.<name>.dsnd-tmp-*` (files fsynced, marker last)
and renamed into place; an earlier export is first renamed aside to `.<name>.dsnd-old-*` and
removed after the new one is in place. A crash therefore leaves the old export or the new one,
never a mix: at worst (between the two renames) the target is missing and both lie beside it,
each whole. The temporary siblings a crashed export left are removed once the next export to the
same target is in place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from dsnd.errors import UserError
from dsnd.fs import fsync, umask

log = logging.getLogger(__name__)

EXPORT_MARKER = "dsnd-export.json"
_FORMAT = "dsnd-export/1"
_TMP, _OLD = ".dsnd-tmp-", ".dsnd-old-"


@dataclass(frozen=True)
class ExportOrigin:
    """The run an export comes from (its checkpoint root; None: no run, e.g. a test's tensors)
    and the step of its weights."""

    root: str | None
    step: int | None

    def run(self) -> str | None:
        return None if self.root is None else os.path.realpath(self.root)


def read_marker(path: str) -> dict | None:
    """The marker of the export at `path`, None when there is no readable one."""
    try:
        with open(os.path.join(path, EXPORT_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(marker, dict)
        and marker.get("format") == _FORMAT
        and isinstance(marker.get("files"), list)
    )
    return marker if ok else None


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_target(path: str, origin: ExportOrigin, where: str) -> dict | None:
    """UserError (one line, starting `where`) unless `origin`'s export may be written at
    `path`; returns the marker of the earlier export it would replace (None: nothing there)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # made by the export: its first existing ancestor counts
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(
            f"{where}: cannot be written ({parent} is not a writable directory; the "
            "export is written beside its target, then renamed)"
        )
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        raise UserError(
            f"{where}: is a symbolic link; name the directory itself (an export "
            "replaces its directory whole)"
        )
    if not os.path.isdir(path):
        raise UserError(f"{where}: exists and is not a directory")
    names = sorted(os.listdir(path))
    if not names:
        return None
    marker = read_marker(path)
    if marker is None:
        raise UserError(
            f"{where}: holds {_names(names)} and no {EXPORT_MARKER}, so it is not an "
            "export dsnd wrote; name a new or empty directory (dsnd replaces only its "
            "own earlier export of the same run)"
        )
    if marker.get("checkpoint_root") != origin.run():
        raise UserError(
            f"{where}: holds dsnd's export of another run (checkpoint root "
            f"{marker.get('checkpoint_root')}, step {marker.get('step')}); this "
            f"run's is {origin.run()}: name another directory, or remove that "
            "export"
        )
    extra = [n for n in names if n != EXPORT_MARKER and n not in marker["files"]]
    if extra:
        raise UserError(
            f"{where}: holds {_names(extra)}, which dsnd's export there did not write "
            "(replacing the export would delete it); move it away or name another "
            "directory"
        )
    return marker


def write_whole(
    path: str, origin: ExportOrigin, write: Callable[[str], None], where: str | None = None
) -> dict | None:
    """Check `path` (`check_target`), let `write(directory)` fill a temporary sibling, add the
    marker and put it in place of `path`; returns the replaced export's marker (or None)."""
    earlier = check_target(path, origin, where or path)
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}{_TMP}", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would become the export's mode
        write(tmp)
        files = sorted(os.listdir(tmp))
        marker = {
            "format": _FORMAT,
            "checkpoint_root": origin.run(),
            "step": origin.step,
            "files": files,
        }
        with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1)
        for file in [*files, EXPORT_MARKER, "."]:
            fsync(os.path.join(tmp, file))
        _swap(tmp, path, parent, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_leftovers(parent, name)  # only now: they may hold the only whole export
    return earlier


def replacing(earlier: dict | None) -> str:
    """What a report of the export adds when it replaced an earlier one."""
    return "" if earlier is None else f" (replacing the export of step {earlier.get('step')} there)"


def _swap(tmp: str, path: str, parent: str, name: str) -> None:
    """Put the finished `tmp` at `path`: one rename onto nothing or an empty directory; else
    the earlier export aside first (put back if the second rename fails), then removed."""
    if not os.path.isdir(path) or not os.listdir(path):
        os.replace(tmp, path)
    else:
        old = tempfile.mkdtemp(prefix=f".{name}{_OLD}", dir=parent)
        os.replace(path, old)  # onto the empty directory mkdtemp made
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync(parent)


def _remove_leftovers(parent: str, name: str) -> None:
    """The temporary siblings an export to `name` left when it crashed."""
    for entry in sorted(os.listdir(parent)):
        if entry.startswith((f".{name}{_TMP}", f".{name}{_OLD}")):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            log.warning(
                "removed %s, left by an export that did not finish", os.path.join(parent, entry)
            )
