"""``dsnd ops build``: compile DeepSpeed's ops before a launch instead of inside one.

DeepSpeed builds its C++ ops (CPU Adam, async I/O, ...) just in time, the first time a rank needs
one, into the environment's op directory (`dsnd.extensions`). Inside a launch that build happens
while the other ranks wait at a collective: the first run of a fresh environment spends minutes
compiling (observed on 2 cores, not in the suite: async_io 2.5 min, each CPU optimizer about
1 min), which can pass a rendezvous or a test's timeout. DeepSpeed's own answer is
``DS_BUILD_OPS=1`` at install time, which needs DeepSpeed built from source; this command builds
the same ops, with the same builders, into the directory every later ``dsnd`` process of this
environment loads them from.

On the CPU it builds every op dsnd's CPU runs may load (DEFAULT_BUILDERS). On CUDA (any other
accelerator) it builds what the DeepSpeed JSON of ``--deepspeed`` (default: the packaged default
run's) will load, as DeepSpeed's engine chooses it (`ops_for`): FusedAdam for Adam(W), CPU Adam
with the optimizer offloaded, FusedLamb, FusedLion or CPU Lion, CPU Adagrad offloaded, async_io
for NVMe offload, the quantizer for ZeRO++ qwZ/qgZ; every other op is printed as skipped, with
the reason. CUDA ops compile for minutes each, so building all of them would cost more than a
first launch does. A build killed midway leaves torch's `lock` file in the op's directory, on
which every later build would wait forever; one that no process holds is removed first, with a
line saying so.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

# The builders dsnd's features load (DeepSpeed's class names): the CPU optimizers and offload's
# Adam, NVMe offload's file I/O, the CPU accelerator's shared-memory collectives and pinned
# memory. On an accelerator that lacks one, its builder says so and it is skipped.
DEFAULT_BUILDERS = (
    "CPUAdamBuilder",
    "CPUAdagradBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "AsyncIOBuilder",
    "ShareMemCommBuilder",
    "PinMemoryBuilder",
)
GPU_BUILDERS = ("FusedLambBuilder", "FusedLionBuilder", "QuantizerBuilder")
"""Ops only a GPU accelerator has (Lamb's and Lion's kernels, ZeRO++'s quantizer)."""
KNOWN_BUILDERS = DEFAULT_BUILDERS + GPU_BUILDERS
_CPU_ONLY = ("ShareMemCommBuilder", "PinMemoryBuilder")


def _offloaded(ds: dict[str, Any]) -> bool:
    """Whether ZeRO offloads the optimizer (to the CPU or NVMe): DeepSpeed then steps it on the
    CPU with its CPU optimizers."""
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    section = zero.get("offload_optimizer")
    return (
        zero.get("stage") in (1, 2, 3)
        and isinstance(section, dict)
        and section.get("device") in ("cpu", "nvme")
    )


OPTIMIZER_OPS = {
    ("adam", False): ("FusedAdamBuilder", "FusedAdam"),
    ("adam", True): ("CPUAdamBuilder", "DeepSpeedCPUAdam"),
    ("lamb", False): ("FusedLambBuilder", "FusedLamb"),
    ("lamb", True): ("FusedLambBuilder", "FusedLamb"),
    ("lion", False): ("FusedLionBuilder", "FusedLion"),
    ("lion", True): ("CPULionBuilder", "DeepSpeedCPULion"),
    ("adagrad", True): ("CPUAdagradBuilder", "DeepSpeedCPUAdagrad"),
}
"""(DeepSpeed's optimizer name, optimizer offloaded) -> (op builder, class) of the optimizers
DeepSpeed's engine builds from its own ops (`dsnd.engine.optimizers`); others are torch's."""


def _optimizer_op(ds: dict[str, Any]) -> tuple[str | None, str]:
    """(the op builder DeepSpeed's engine loads for the JSON's optimizer, or None; what the
    engine builds, in words)."""
    section = ds.get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return None, "the JSON has no optimizer"
    kind = section["type"]
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    name = "adam" if kind.lower() in ("adam", "adamw") else kind.lower()
    found = OPTIMIZER_OPS.get((name, _offloaded(ds)))
    if found is None or (name == "adam" and params.get("torch_adam")):
        return None, f"the JSON's optimizer '{kind}' is torch's"
    where = " (offloaded)" if _offloaded(ds) else ""
    return found[0], f"the JSON's optimizer '{kind}'{where} is {found[1]}"


def ops_for(ds: dict[str, Any], accelerator: str) -> tuple[list[str], dict[str, str]]:
    """(the op builders to build, in KNOWN_BUILDERS order; {builder: why it is skipped}) for
    DeepSpeed JSON `ds` on the accelerator named `accelerator` (DeepSpeed's device name). On
    the CPU every op dsnd's CPU runs may load, whatever the JSON; elsewhere those the JSON's
    run will load."""
    if accelerator == "cpu":
        return list(DEFAULT_BUILDERS), {}
    from dsnd.config.ds_offload import uses_nvme

    op, optimizer = _optimizer_op(ds)
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    quantized = zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")
    by_feature = {
        "AsyncIOBuilder": None if uses_nvme(ds) else "nothing is offloaded to NVMe",
        "QuantizerBuilder": None if quantized else "ZeRO++ qwZ/qgZ are off",
    }
    skipped = {}
    for name in KNOWN_BUILDERS:
        if name in _CPU_ONLY:
            skipped[name] = f"an op of DeepSpeed's CPU accelerator; {accelerator} has its own"
        elif name in by_feature and by_feature[name]:
            skipped[name] = by_feature[name]
        elif name not in by_feature and name != op:
            skipped[name] = f"not needed: {optimizer}"
    return [n for n in KNOWN_BUILDERS if n not in skipped], skipped


def _unavailable(builder) -> str | None:
    """Why this accelerator cannot build `builder`, or None."""
    if type(builder).__name__ == "NotImplementedBuilder":
        return "this accelerator has no such op"
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's builder says it is not compatible here (see 'ds_report')"
    return None


def _unlock(name: str, op: str) -> None:
    """Remove (and say so) the build lock a killed build of `op` left in this environment's op
    directory: torch's build would otherwise wait for it forever (`remove_stale_lock`)."""
    from dsnd.extensions import VARIABLE, remove_stale_lock

    if os.environ.get(VARIABLE):  # set by dsnd.cli.main (or by the user) before any build
        said = remove_stale_lock(os.path.join(os.environ[VARIABLE], op))
        if said:
            print(f"{name:<20} {said}", flush=True)


def run_build(names: list[str], deepspeed: str | None = None) -> int:
    """Build `names`, or without names what `ops_for` chooses for the JSON `deepspeed`."""
    from dsnd.config.deepspeed_json import load_json
    from dsnd.config.packaged import packaged_json
    from dsnd.engine.compat import log_op_builds
    from dsnd.engine.public import accelerator as get_accelerator
    from dsnd.errors import UserError

    unknown = [n for n in names if n not in KNOWN_BUILDERS]
    if unknown:
        raise UserError(
            f"dsnd ops build: unknown op builder {', '.join(unknown)} "
            f"(known: {', '.join(KNOWN_BUILDERS)})"
        )
    ds = load_json(deepspeed or packaged_json(0))  # the default run's JSON (zero0.json)
    log_op_builds()
    accelerator = get_accelerator()
    build, skipped = (names, {}) if names else ops_for(ds, accelerator.device_name())
    for name, why in skipped.items():
        print(f"{name:<20} skipped: {why}", flush=True)
    failed = 0
    for name in build:
        builder = accelerator.create_op_builder(name)
        why = None if builder is None else _unavailable(builder)
        if builder is None or why:
            print(f"{name:<20} skipped: {why or 'this accelerator has no such op'}", flush=True)
            continue
        _unlock(name, builder.name)
        start = time.monotonic()
        try:
            builder.load(verbose=False)
        except Exception as e:  # a compiler error: report it, build the rest
            failed += 1
            print(f"{name:<20} FAILED: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        print(f"{name:<20} ready ({builder.name}, {time.monotonic() - start:.1f} s)", flush=True)
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """``dsnd ops build [BUILDER ...]``."""
    return run_build(args.names, args.deepspeed)
