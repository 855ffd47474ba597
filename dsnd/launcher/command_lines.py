"""Launcher argv builders: every input explicit, every output a plain list, tested on argv alone.

Every rank runs `python -m dsnd train <train_args...>`. Through DeepSpeed's runner that is
`deepspeed ... --module dsnd train ...`; its per-node `launch.py` appends `--local_rank=N`, which
dsnd's CLI strips. Through mpirun or srun, dsnd starts the ranks itself and the rank order is
fixed by `placement()`: hosts in hostfile order, each host's ranks consecutive.
"""

from __future__ import annotations

import shlex

from dsnd.errors import UserError
from dsnd.launcher.devices import VISIBLE_DEVICES, mpirun_devices_env

# Set from the explicit arguments and the slots; an env file cannot override them (as in
# DeepSpeed, whose launch.py sets them from --master_addr/--master_port and the selected slots
# after the exports are applied).
_MASTER_KEYS = ("MASTER_ADDR", "MASTER_PORT", VISIBLE_DEVICES)


def deepspeed_local_argv(
    nprocs: int, master_addr: str, master_port: int, train_args: list[str]
) -> list[str]:
    """`deepspeed` on this machine only, `nprocs` ranks."""
    return [
        "deepspeed",
        "--num_gpus",
        str(nprocs),
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        "--module",
        "dsnd",
        "train",
        *train_args,
    ]


def deepspeed_hostfile_argv(
    hostfile: str,
    launcher: str,
    master_addr: str,
    master_port: int,
    include: str | None,
    exclude: str | None,
    train_args: list[str],
    force_multi: bool = False,
) -> list[str]:
    """`deepspeed --hostfile` across hosts (launcher `pdsh`, or one of DeepSpeed's MPI backends).

    `force_multi`: DeepSpeed runs a selection of a single host with its local launcher on *this*
    machine, even when that host is remote; pass True to go through `launcher` anyway.
    """
    argv = ["deepspeed", "--hostfile", hostfile, "--launcher", launcher]
    if include:
        argv += ["--include", include]
    if exclude:
        argv += ["--exclude", exclude]
    if force_multi:
        argv.append("--force_multi")
    argv += ["--master_addr", master_addr, "--master_port", str(master_port)]
    return [*argv, "--module", "dsnd", "train", *train_args]


def placement(slots: dict[str, list[int]]) -> list[tuple[str, int]]:
    """(host, local_rank) for each global rank, in rank order.

    Ranks fill hosts in order, as DeepSpeed's launch.py numbers them; local_rank counts 0.. within
    a host and indexes the host's selected slots (DeepSpeed sets CUDA_VISIBLE_DEVICES to them).
    """
    return [(host, i) for host, host_slots in slots.items() for i in range(len(host_slots))]


def _host_counts(slots: dict[str, list[int]]) -> list[str]:
    """`host:count` items; mpirun can place ranks by count only, not on chosen device ids."""
    if not slots:
        raise ValueError("no hosts to launch on")
    items = []
    for host, host_slots in slots.items():
        if host_slots != list(range(len(host_slots))):
            raise UserError(
                f"mpirun places ranks by count and cannot use slots {host_slots} on host "
                f"{host!r}; select leading slots (0..{len(host_slots) - 1}) or whole hosts"
            )
        items.append(f"{host}:{len(host_slots)}")
    return items


def mpirun_argv(
    flavor: str,
    slots: dict[str, list[int]],
    master_addr: str,
    master_port: int,
    env: dict[str, str],
    python: str,
    train_args: list[str],
    as_root: bool,
) -> list[str]:
    """`mpirun` for Open MPI (`flavor="openmpi"`) or MPICH/Hydra (`"mpich"`), one rank per slot.

    Ranks are mapped slot by slot in host order (`h1:2,h2:2` -> ranks 0,1 on h1 and 2,3 on h2), so
    rank r lands where `placement(slots)[r]` says. `as_root` adds Open MPI's
    `--allow-run-as-root` (containers); MPICH needs no such flag. CUDA_VISIBLE_DEVICES is the
    hosts' leading slots (`devices.mpirun_devices_env`), over any value in `env`.
    """
    hosts = ",".join(_host_counts(slots))
    nprocs = str(sum(len(s) for s in slots.values()))
    exports = [
        ("MASTER_ADDR", master_addr),
        ("MASTER_PORT", str(master_port)),
        *mpirun_devices_env(slots).items(),
    ]
    exports += [(k, v) for k, v in env.items() if k not in _MASTER_KEYS]
    program = [python, "-m", "dsnd", "train", *train_args]
    if flavor == "openmpi":
        argv = ["mpirun", "-np", nprocs, "--host", hosts, "--map-by", "slot", "--oversubscribe"]
        if as_root:
            argv.append("--allow-run-as-root")
        for key, value in exports:
            argv += ["-x", f"{key}={value}"]
        return argv + program
    if flavor == "mpich":
        argv = ["mpirun", "-n", nprocs, "-hosts", hosts]
        for key, value in exports:
            argv += ["-genv", key, value]
        return argv + program
    raise ValueError(f"unknown MPI flavor {flavor!r}; expected 'openmpi' or 'mpich'")


def srun_argv(
    slots: dict[str, list[int]] | None,
    nprocs: int | None,
    master_addr: str,
    master_port: int,
    step_name: str,
    python: str,
    train_args: list[str],
) -> list[str]:
    """`srun` for the hosts of `slots` (Slurm node names), or for `nprocs` tasks on one node.

    srun starts the same number of tasks on every node, rank r on the node `placement(slots)`
    gives it (`--distribution=block`); a rank that fails ends the step (`--kill-on-bad-exit`).
    The step is named `step_name` so that a stop request can signal exactly it (`scancel_argv`).
    CUDA_VISIBLE_DEVICES is Slurm's to set (its GPU binding of each task), not dsnd's.
    """
    if slots is not None:
        counts = {int(item.rpartition(":")[2]) for item in _host_counts(slots)}
        if len(counts) != 1:
            shown = ", ".join(f"{h}:{len(s)}" for h, s in slots.items())
            raise UserError(
                f"srun starts the same number of tasks on every node; the hosts have "
                f"{shown}: select as many slots on each"
            )
        per_node, nodes = counts.pop(), len(slots)
        where = [f"--nodelist={','.join(slots)}"]
    else:
        per_node, nodes, where = nprocs, 1, []
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes * per_node}",
        f"--ntasks-per-node={per_node}",
        *where,
        "--distribution=block",
        "--kill-on-bad-exit=1",
        f"--job-name={step_name}",
        f"--export=ALL,MASTER_ADDR={master_addr},MASTER_PORT={master_port}",
        python,
        "-u",
        "-m",
        "dsnd",
        "train",
        *train_args,
    ]


def squeue_steps_argv(step_name: str) -> list[str]:
    """The ids (`JOB.STEP`) of the running job steps named `step_name`."""
    return ["squeue", "--steps", "--noheader", "--format=%i", f"--name={step_name}"]


def scancel_argv(signal_name: str, step_ids: list[str]) -> list[str]:
    """Send `signal_name` to the tasks of job steps `step_ids` (each task gets it, as from the
    time-limit `--signal`; srun itself, signalled, would end the step at once)."""
    return ["scancel", f"--signal={signal_name}", *step_ids]


SSH = ["ssh", "-o", "BatchMode=yes"]  # never wait for a password prompt


def python_module_argv(
    host: str | None, python: str, module: str, cwd: str, pythonpath: str | None
) -> list[str]:
    """Run `python -m module` in `cwd`: here when `host` is None, else over ssh on `host`.

    The remote command is the only shell text dsnd sends; every part of it is quoted. The same
    interpreter path and working directory are assumed on every host (a shared environment), as
    DeepSpeed's runner assumes. PYTHONPATH goes along so the agent imports the same dsnd.
    """
    program = [python, "-u", "-m", module]
    if host is None:
        return program
    prefix = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else []
    return [*SSH, host, f"cd {shlex.quote(cwd)} && exec {shlex.join(prefix + program)}"]
