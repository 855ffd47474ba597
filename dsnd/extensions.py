"""Where DeepSpeed's JIT-built ops go: a directory per Python environment, not per user.

torch builds C++ extensions under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions/py311_cpu``: one directory for every environment of the user with the
same Python and accelerator. DeepSpeed JIT-builds its ops there on first use (the shared-memory
comm op at every CPU start, CPU Adam when a JSON asks for it). Two environments with different
DeepSpeed or torch builds then rebuild each other's ops at every start (observed, not in the
suite: a 4-step run took 25 s alone and 2.5 min while another environment ran), and a build
killed midway leaves a `lock` file there that stalls every later run of every environment.

So unless the user set ``TORCH_EXTENSIONS_DIR``, `dsnd.cli.main` points it, before DeepSpeed is
imported, at a directory of this environment: ``<sys.prefix>/var/dsnd/torch_extensions`` in a
virtualenv or conda environment that this user can write, else
``~/.cache/dsnd/torch_extensions/<hash of sys.prefix>``. Every rank runs ``dsnd train`` (or
``launch/train.py``, which calls the same `main`) from the same environment, so all of them
compute the same directory; the variable is not forwarded to other hosts, which compute their own.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Mapping, MutableMapping

VARIABLE = "TORCH_EXTENSIONS_DIR"
LOCK = "lock"  # torch's FileBaton in an op's build directory: created, held open, removed


def prefix_dir(prefix: str) -> str:
    """The op directory inside the environment at `prefix`."""
    return os.path.join(prefix, "var", "dsnd", "torch_extensions")


def extensions_dir(env: Mapping[str, str], prefix: str, prefix_usable: bool) -> str | None:
    """The directory for JIT-built ops, or None when the user chose one (`env` sets it).

    `prefix` is the environment's `sys.prefix`; `prefix_usable` says whether builds may live
    under it (an environment of its own that this user can write).
    """
    if env.get(VARIABLE):
        return None
    if prefix_usable:
        return prefix_dir(prefix)
    home = env.get("HOME") or os.path.expanduser("~")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    digest = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return os.path.join(cache, "dsnd", "torch_extensions", digest)


def _own_environment(prefix: str) -> bool:
    """A virtualenv or a conda environment; not a system Python, whose prefix (/usr) is no place
    for a cache."""
    return prefix != sys.base_prefix or os.path.isdir(os.path.join(prefix, "conda-meta"))


def _creatable(path: str) -> bool:
    """Whether `path` is a writable directory or can be made (its nearest existing ancestor is a
    writable directory); nothing is created."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def use_environment_dir(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``TORCH_EXTENSIONS_DIR`` in `env` (default: this process's environment, inherited by
    the ranks a launcher starts here) unless the user set it; the directory set, or None."""
    env = os.environ if env is None else env
    prefix = sys.prefix
    usable = _own_environment(prefix) and _creatable(prefix_dir(prefix))
    chosen = extensions_dir(env, prefix, usable)
    if chosen is not None:
        env[VARIABLE] = chosen
    return chosen


def _held_here(path: str) -> bool | None:
    """Whether a process of this host has `path` open (True/False); None where /proc does not
    say (not Linux). torch's build holds its lock file's descriptor for the whole build."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(path)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:  # gone, or another user's
            continue
        for fd in names:
            try:
                if os.readlink(os.path.join(fds, fd)) == target:
                    return True
            except OSError:
                continue
    return False


def remove_stale_lock(build_dir: str, settle_s: float = 1.0) -> str | None:
    """Remove the build `lock` of `build_dir` that no process holds, and say so (None: there is
    none, or one is held). A build killed midway (SIGKILL, a test's timeout) leaves it, and
    every later build of the op then waits for it forever. A build finishing closes the file a
    moment before removing it: it counts as stale only when nobody holds it twice, `settle_s`
    apart. (A build on another host sharing this directory holds nothing here: `dsnd ops build`
    is run on one host, before a launch.)"""
    lock = os.path.join(build_dir, LOCK)
    for attempt in range(2):
        if not os.path.isfile(lock) or _held_here(lock) is not False:
            return None
        if attempt == 0:
            time.sleep(settle_s)
    try:
        os.remove(lock)
    except FileNotFoundError:
        return None
    return f"removed the stale build lock {lock} (no process holds it: a build was killed midway)"
