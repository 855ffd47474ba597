"""Hostfiles, `--include/--exclude` slot filters and `.deepspeed_env` files, as pure functions.

dsnd hands the same hostfile and filters to `deepspeed --hostfile`, so what these functions compute
must be exactly what DeepSpeed's runner (`deepspeed/launcher/runner.py`) will do: the rank table
dsnd prints before launch is only true if the slot selection matches. Where DeepSpeed would accept
nonsense silently (`slots=0`, `slots=4x`, a trailing `max_slots=8`) or crash with a bare
ValueError, these raise `UserError` naming the file, line and value instead.

Host names end up as arguments of ssh, pdsh, mpirun and srun and inside remote shell text, so
only what a host can be is kept (`host_name_problem`): a host name of RFC 1123 labels, an IPv4
or an IPv6 address. `-oProxyCommand=...`, `h;rm`, `h${IFS}x` or a non-ASCII look-alike is refused
by its hostfile line before anything runs.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from dsnd.distributed.slurm import expand_hostlist, expand_tasks_per_node
from dsnd.errors import UserError

_DIGITS = re.compile(r"[0-9]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOST_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")
_ZONE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # an interface name: eth0, enp0s3, br-lan


@dataclass(frozen=True)
class Host:
    """One hostfile line: a host name and how many accelerator slots it offers."""

    name: str
    slots: int


def _zone_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """An IPv6 zone (`fe80::1%eth0`) must be an interface name: Python's parser takes any text."""
    zone = getattr(address, "scope_id", None)
    if zone is not None and not _ZONE.fullmatch(zone):
        return f"its IPv6 zone {zone!r} is not an interface name"
    return None


def host_name_problem(name: str) -> str | None:
    """Why `name` cannot be a host (an RFC 1123 name, an IPv4 or IPv6 address), or None."""
    try:
        return _zone_problem(ipaddress.ip_address(name))
    except ValueError:
        pass
    if name.startswith("-"):
        return "it starts with '-' (ssh, pdsh and mpirun would read an option)"
    bad = [c for c in dict.fromkeys(name) if c not in _HOST_CHARS]
    if bad:
        return "it has " + ", ".join(repr(c) for c in bad)
    if len(name) > 253:
        return f"it is {len(name)} characters (at most 253)"
    labels = name.split(".")
    if len(labels) == 4 and all(label.isdigit() for label in labels):
        return "it looks like an IPv4 address but is not one"
    for label in labels:
        if not label:
            return "it has an empty label"
        if len(label) > 63:
            return f"label {label[:10] + '...'!r} is {len(label)} characters (at most 63)"
        if label.startswith("-") or label.endswith("-"):
            return f"label {label!r} starts or ends with '-'"
    return None


def check_host_name(name: str, where: str) -> None:
    """Raise `UserError` at `where` (a hostfile line, a Slurm variable) for a name no host has."""
    why = host_name_problem(name)
    if why is not None:
        raise UserError(f"{where}: {name!r} is not a host name or IP address: {why}")


def parse_hostfile_text(text: str, path: str) -> list[Host]:
    """Hosts from DeepSpeed hostfile text (`HOSTNAME slots=N` per line), in file order.

    File order matters: DeepSpeed numbers ranks host by host in this order. `#` starts a comment
    (DeepSpeed tolerates trailing text after `slots=N`, so inline comments work there too).
    """
    hosts: list[Host] = []
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        tokens = raw.split("#", 1)[0].split()
        if not tokens:
            continue
        where = f"{path}:{lineno}"
        name, rest = tokens[0], tokens[1:]
        if name.startswith("slots="):
            raise UserError(f"{where}: missing host name before {name!r}")
        if not rest or not rest[0].startswith("slots="):
            got = f", got {rest[0]!r}" if rest else ""
            raise UserError(f"{where}: expected 'slots=N' after host {name!r}{got}")
        if len(rest) > 1:
            raise UserError(f"{where}: unexpected {' '.join(rest[1:])!r} after {rest[0]!r}")
        check_host_name(name, where)
        value = rest[0][len("slots=") :]
        if not _DIGITS.fullmatch(value) or int(value) == 0:
            raise UserError(f"{where}: slots must be a positive integer, got {value!r}")
        if name in first_line:
            raise UserError(f"{where}: duplicate host {name!r} (first on line {first_line[name]})")
        first_line[name] = lineno
        hosts.append(Host(name, int(value)))
    if not hosts:
        raise UserError(f"{path}: no hosts")
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """Read and parse a hostfile; see `parse_hostfile_text`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        raise UserError(f"{path}: hostfile not found") from None
    return parse_hostfile_text(text, path)


def allocation_hosts(env: dict[str, str]) -> list[Host]:
    """The hosts of the Slurm allocation this process runs in (SLURM_JOB_NODELIST, with
    SLURM_TASKS_PER_NODE as each host's slots), as a hostfile would list them."""
    nodelist, tasks = env.get("SLURM_JOB_NODELIST"), env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        raise UserError(
            "--launcher slurm without --hostfile or --nprocs takes the hosts of the "
            "Slurm allocation it runs in, and this process is in none (no "
            "SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE): run it inside sbatch or "
            "salloc, or pass --hostfile with Slurm node names"
        )
    try:
        names, counts = expand_hostlist(nodelist), expand_tasks_per_node(tasks)
    except ValueError as e:
        raise UserError(f"SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE: {e}") from None
    for name in names:
        check_host_name(name, f"SLURM_JOB_NODELIST={nodelist}")
    if len(names) != len(counts):
        raise UserError(
            f"SLURM_JOB_NODELIST={nodelist} names {len(names)} nodes but "
            f"SLURM_TASKS_PER_NODE={tasks} counts {len(counts)}"
        )
    return [Host(name, n) for name, n in zip(names, counts, strict=True)]


def _parse_filter(spec: str, flag: str) -> dict[str, list[int]]:
    """`host1@host2:0,2` -> {host: sorted unique slots}; [] means "the whole host".

    Mirrors DeepSpeed's `parse_node_config_list`, including its merge: a host named both bare and
    with slots (`h@h:0`) ends up with just those slots.
    """
    out: dict[str, list[int]] = {}
    for node in spec.split("@"):
        name, sep, slot_text = node.partition(":")
        slots: list[int] = []
        if sep:
            for item in slot_text.split(","):
                if not _DIGITS.fullmatch(item.strip()):
                    raise UserError(f"{flag} {spec!r}: bad slot {item!r} for host {name!r}")
                slots.append(int(item))
        out[name] = sorted(set(out.get(name, []) + slots))
    return out


def _check_known(pool: dict[str, list[int]], wanted: dict[str, list[int]], flag: str) -> None:
    for name, slots in wanted.items():
        if name not in pool:
            raise UserError(f"{flag}: unknown host {name!r}; hostfile has {', '.join(pool)}")
        for slot in slots:
            if slot not in pool[name]:
                raise UserError(
                    f"{flag}: host {name!r} has no slot {slot}; "
                    f"its slots are 0..{len(pool[name]) - 1}"
                )


def select_slots(
    hosts: list[Host], include: str | None, exclude: str | None
) -> dict[str, list[int]]:
    """The local slot indices each host contributes after DeepSpeed's `--include/--exclude`.

    Syntax `NAME[:SLOT[,SLOT...]][@NAME...]`; a bare name means all of its slots. The result keeps
    hostfile order (not filter order) with slots ascending, as DeepSpeed's runner does, because
    that order fixes global rank numbering. An empty string counts as not given, as in DeepSpeed.
    """
    pool = {h.name: list(range(h.slots)) for h in hosts}
    if include and exclude:
        raise UserError("--include and --exclude are mutually exclusive")
    if not include and not exclude:
        return pool
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    assert spec is not None
    wanted = _parse_filter(spec, flag)
    _check_known(pool, wanted, flag)
    if flag == "--include":
        chosen = {name: wanted[name] or pool[name] for name in pool if name in wanted}
    else:
        chosen = {}
        for name, slots in pool.items():
            drop = wanted.get(name)
            if drop is None:
                chosen[name] = slots
            elif drop:  # `h:0,1` drops those slots; a bare `h` drops the whole host
                chosen[name] = [s for s in slots if s not in drop]
        chosen = {name: slots for name, slots in chosen.items() if slots}
    if not chosen:
        raise UserError(f"{flag} {spec!r} leaves no slots to run on")
    return chosen


def deepspeed_env_paths(home: str, cwd: str, name: str = ".deepspeed_env") -> list[str]:
    """Where DeepSpeed's runner looks for its env file: home first, then the working directory.

    `name` is `$DS_ENV_FILE` when set. The later file wins for keys set in both.
    """
    return [os.path.join(home, name), os.path.join(cwd, name)]


def read_deepspeed_env(paths: list[str]) -> dict[str, str]:
    """Variables from `.deepspeed_env` files (`KEY=VALUE` lines), later paths overriding earlier.

    DeepSpeed exports these on every node of a multi-node launch; dsnd's MPI launch passes them
    the same way. As in DeepSpeed, the value is everything after the first `=`, with key and value
    stripped of surrounding whitespace, and missing files are skipped. Unlike DeepSpeed (which
    crashes on a blank line and would put `#X=1` into a shell `export`), blank lines are skipped
    and a line whose key is not a variable name is an error.
    """
    env: dict[str, str] = {}
    for path in paths:
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read: {e}") from None
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if not sep:
                raise UserError(f"{path}:{lineno}: expected KEY=VALUE, got {line.strip()!r}")
            if not _ENV_NAME.fullmatch(key):
                raise UserError(f"{path}:{lineno}: invalid variable name {key!r}")
            env[key] = value.strip()
    return env
