"""Which GPUs a host's ranks see: CUDA_VISIBLE_DEVICES from the host's selected slots.

A hostfile line `host slots=4` offers device ids 0..3 of that host; `--include host:1,3` or
`--exclude host:0` selects some of them. DeepSpeed's per-host launch.py sets every rank's
CUDA_VISIBLE_DEVICES to the host's selected ids (`1,3`), and rank i of the host uses device i
of those (`dsnd.distributed.init.cuda_device_index`). dsnd's launchers do the same, and decide
as DeepSpeed does when the variable is already set: the selection wins. launch.py sets it after
the `.deepspeed_env` exports, so a value in the launching shell, a host's login environment,
`launch.env` or `.deepspeed_env` never reaches a rank; to use other devices, select their
slots. (DeepSpeed's runner reads a shell's CUDA_VISIBLE_DEVICES only without a hostfile and
without --num_gpus, as an --include; dsnd's `--nprocs N` is its --num_gpus: slots 0..N-1.)

Where each path sets it: dsnd's agent for each of its host's ranks (`AgentSpec.devices`);
mpirun exports one value for every host (`mpirun_devices_env`); DeepSpeed's runner sets it
itself; srun leaves it to Slurm, which binds each task's GPUs (gres) and sets the variable per
task: a value from dsnd would fight that binding.
"""

from __future__ import annotations

from collections.abc import Sequence

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_devices_env(slots: Sequence[int]) -> dict[str, str]:
    """The variable for the ranks of a host whose selected slots are `slots` (ascending)."""
    return {VISIBLE_DEVICES: ",".join(str(s) for s in slots)}


def mpirun_devices_env(slots: dict[str, list[int]]) -> dict[str, str]:
    """One value for every host of an mpirun launch (mpirun exports a variable to all hosts
    alike). mpirun places ranks by count, so each host's slots are leading ones (0..n-1,
    `command_lines._host_counts` refuses others) and devices 0..max(n)-1 serve every host: a
    host's local ranks 0..n-1 use its first n."""
    return visible_devices_env(range(max((len(s) for s in slots.values()), default=0)))


def ignored_note(environ: dict[str, str], slots: dict[str, list[int]]) -> str | None:
    """A note for a launching shell whose CUDA_VISIBLE_DEVICES the ranks will not get (DeepSpeed
    prints one too), or None when it is unset, empty, or what every host's ranks get anyway."""
    value = environ.get(VISIBLE_DEVICES)
    if not value or all(visible_devices_env(s)[VISIBLE_DEVICES] == value for s in slots.values()):
        return None
    return (
        f"{VISIBLE_DEVICES}={value} of this shell is not passed to the ranks: each host's "
        "ranks see the slots selected for it (a hostfile's slots=N, --include "
        "HOST:2,3)"
    )
