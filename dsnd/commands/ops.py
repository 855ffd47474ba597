"""``dsnd ops build``: compile DeepSpeed's ops before a launch instead of inside one.

DeepSpeed builds its C++ ops (CPU Adam, async I/O, ...) just in time, the first time a rank needs
one, into the environment's op directory (`dsnd.extensions`). Inside a launch that build happens
while the other ranks wait at a collective: the first run of a fresh environment spends minutes
compiling (measured on 2 cores: async_io 2.5 min, each CPU optimizer about 1 min), which can pass
a rendezvous or a test's timeout. DeepSpeed's own answer is ``DS_BUILD_OPS=1`` at install time,
which needs DeepSpeed built from source; this command builds the same ops, with the same
builders, into the directory every later ``dsnd`` process of this environment loads them from.
"""

from __future__ import annotations

import argparse
import time

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


def _unavailable(builder) -> str | None:
    """Why this accelerator cannot build `builder`, or None."""
    if type(builder).__name__ == "NotImplementedBuilder":
        return "this accelerator has no such op"
    if not builder.is_compatible(verbose=False):
        return "DeepSpeed's builder says it is not compatible here (see 'ds_report')"
    return None


def run_build(names: list[str]) -> int:
    from dsnd.engine.compat import log_op_builds
    from dsnd.engine.public import accelerator as get_accelerator
    from dsnd.errors import UserError

    unknown = [n for n in names if n not in DEFAULT_BUILDERS]
    if unknown:
        raise UserError(f"dsnd ops build: unknown op builder {', '.join(unknown)} "
                        f"(known: {', '.join(DEFAULT_BUILDERS)})")  # fmt: skip
    log_op_builds()
    accelerator = get_accelerator()
    failed = 0
    for name in names or DEFAULT_BUILDERS:
        builder = accelerator.create_op_builder(name)
        why = None if builder is None else _unavailable(builder)
        if builder is None or why:
            print(f"{name:<20} skipped: {why or 'this accelerator has no such op'}", flush=True)
            continue
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
    return run_build(args.names)
