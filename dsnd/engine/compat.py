"""Shims for DeepSpeed 0.19.8 behaviour that dsnd works around; the private names they use.

ZeRO-3 checks its parameter trace with `assert_ints_same_as_other_ranks`, a WORLD-wide collective
(it takes no group). With pipeline stages holding different layers, ranks of different stages
compare different traces at different times and the job hangs (as the pp=2 ZeRO-3 cases of
`tests/distributed/test_parity_pipeline.py` would without the scoped check). The check only makes
sense among the ranks that shard the same parameters: the stage's data-parallel group. DeepSpeed
imports the function by name into three modules, so the scoped version is installed in each.

DeepSpeed JIT-builds an op (C++ compiled by ninja) the first time an environment uses it, in
silence: a run seemed to hang for the length of the build. `log_op_builds` wraps
`deepspeed.ops.op_builder.builder.OpBuilder.jit_load` (the method every builder's `load` calls
when the op was not installed precompiled) so that a build says what it builds, that it happens
on the first run only, about how long it takes (`build_estimate`), where, and how long it took;
loading an op built before logs nothing at INFO. It also silences the line DeepSpeed's comm
layer prints (`build_shm_op` in `deepspeed.comm.torch`: "DeepSpeed ... built successfully"),
which came once per rank at every start, a build or only a load. Observed (not in the suite) with
one CPU core shared with other jobs, `dsnd train --set train.steps=1` with an empty
`TORCH_EXTENSIONS_DIR`: building the shared-memory comm op `deepspeed_shm_comm` took 42 s of the
run's 50 s; the same run with the op built took 8 s in all, its load under 0.1 s. It finds the
build directory with torch's private `torch.utils.cpp_extension._get_build_directory` (the
function torch's `load` itself uses) and tells a build from a load by the op's library file
(`NAME.so` there) appearing or changing. Builders that override `jit_load` (DeepSpeed's XPU ones)
are not wrapped.

DeepSpeed's warmup schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) call their own `get_lr`
from their constructor, before their first step, and it warns "Attempting to get learning rate
from scheduler before it has started" there: once per rank in every run, about nothing the user
did (the constructor sets the warmup's first rate, as intended). `quiet_scheduler_start` drops
that one message while the engine is built; asked later, it still shows.

DeepSpeedCPUAdam (ZeRO-Offload's optimizer when the JSON does not ask for `torch_adam`) keeps
its bias corrections' beta1^t, beta2^t in its C++ op, per optimizer, as a float32 product
multiplied by beta once per step (`Adam_Optimizer::IncrementStep`); a fresh optimizer handed a
later step computes `pow(beta, t)` instead, which differs in the last bit, and so does every
resumed update (5 steps + save + resume 5 then differ from 10 straight steps in the 7th decimal
of the loss; z3-offload of `tests/distributed/test_offload.py` asserts them equal bit for bit).
`replay_cpu_adam_steps` walks a resumed optimizer's op through steps 1..t on empty tensors
(`ds_opt_adam.adam_update` with the optimizer's `opt_id`: no arithmetic, only the counters), so
it holds the uninterrupted run's products; step 1 always sets beta^1 exactly, so any earlier
state of the op is overwritten.

At ZeRO-0 with bf16 or fp16 DeepSpeed wraps the optimizer in `FP16_UnfusedOptimizer`, whose
constructor (`initialize_optimizer_states`) runs the torch optimizer's `step()` once on zero
gradients to create its state. For Adam that counts a step (its bias corrections then run one
step ahead) and for AdamW it applies the decoupled weight decay to every fp32 master once, before
training starts (pp=2 ZeRO-0 fp16 then gave 5.5084 after the first step where the fp32
reference gives 5.4859, outside the 1e-3 `tests/distributed/test_fp16.py` holds it to). ZeRO 1-3
build no such step. `undo_unfused_init_step` puts the optimizer back as it was before that call:
state empty (created at the first real step, as everywhere else) and the masters equal to the
parameters they were cloned from (which the call did not touch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ZERO3_MODULES = (
    "deepspeed.runtime.zero.utils",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.partitioned_param_coordinator",
)


def scope_zero3_trace_checks(group: dist.ProcessGroup, device: torch.device) -> None:
    """Make ZeRO-3's trace check compare only within `group` (the stage's data-parallel group),
    with its tensors on `device` (the accelerator's: an NCCL group takes device tensors only).
    The check runs when ZeRO-3 completes a parameter trace, not per layer: its host syncs stay."""
    src = dist.get_process_group_ranks(group)[0]

    def assert_ints_same_in_group(ints: list[int]) -> None:
        # max and -min in one collective, so every rank sees the same verdict (no half-hang)
        bounds = torch.tensor([len(ints), -len(ints)], dtype=torch.long, device=device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        if bounds[0].item() != -bounds[1].item():
            raise RuntimeError(f"ZeRO-3 trace lengths differ in the data-parallel group: {bounds}")
        first = torch.tensor(list(ints), dtype=torch.long, device=device)
        dist.broadcast(first, src=src, group=group)
        if first.tolist() != list(ints):
            raise RuntimeError(
                f"ZeRO-3 trace differs from rank {src}'s: {list(ints)} vs {first.tolist()}"
            )

    for name in ZERO3_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "assert_ints_same_as_other_ranks"):
            module.assert_ints_same_as_other_ranks = assert_ints_same_in_group


# observed on 2 cores (not in the suite): the shm comm op 25-77 s, each CPU optimizer about
# 1 min, async_io 2.5 min
_SLOW_BUILDS = {"async_io": "a few minutes"}
SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


def build_estimate(name: str) -> str:
    """About how long op `name` takes to build, for the line that says a build starts."""
    return _SLOW_BUILDS.get(name, "about a minute")


def _library_mtime(build_dir: str, name: str) -> float | None:
    try:
        return os.stat(os.path.join(build_dir, f"{name}.so")).st_mtime
    except OSError:
        return None


def _note_start(name: str, build_dir: str, before: float | None) -> None:
    """Before a first build: what is built, that it happens once, about how long. torch waits,
    silently and without end, while another process's build lock exists: say that instead
    (on a first run of several ranks one builds and the others wait)."""
    first = f"first run only, {build_estimate(name)}"
    lock = os.path.join(build_dir, "lock")
    if before is not None and _lock_stays(lock, LOCK_GRACE_S):
        log.info(
            "waiting for %s: another process is building DeepSpeed op %s (a build killed "
            "midway leaves the lock behind: delete it if none is running)",
            lock,
            name,
        )
    elif before is None and os.path.exists(lock):
        log.info(
            "waiting for %s: another process is building DeepSpeed op %s (%s; a build "
            "killed midway leaves the lock behind: delete it if none is running)",
            lock,
            name,
            first,
        )
    elif before is None:
        log.info("building DeepSpeed op %s (%s) in %s ...", name, first, build_dir)


LOCK_GRACE_S = 2.0
"""How long another rank's lock on a built op may stay before the wait is worth a line: its
freshness check before a load takes well under a second (observed, not in the suite: the lock
of a 2-rank start is there for a moment on every run)."""


def _lock_stays(lock: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(lock):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def _note_done(name: str, build_dir: str, before: float | None, seconds: float) -> None:
    """A build (the library is new) or rebuild (it changed) at INFO; a plain load at DEBUG."""
    if before is None:
        log.info("built DeepSpeed op %s in %.0f s", name, seconds)
    elif _library_mtime(build_dir, name) != before:
        log.info(
            "rebuilt DeepSpeed op %s in %.0f s (its sources or flags changed; cached in %s)",
            name,
            seconds,
            build_dir,
        )
    else:
        log.debug("loaded DeepSpeed op %s from %s in %.2f s", name, build_dir, seconds)


def logged_jit_load(jit_load: Callable[..., Any]) -> Callable[..., Any]:
    """`jit_load(builder, ...)`, logging a build before it starts and with its duration after."""
    from torch.utils.cpp_extension import _get_build_directory

    @functools.wraps(jit_load)
    def wrapper(builder: Any, *args: Any, **kwargs: Any) -> Any:
        name = builder.name
        build_dir = _get_build_directory(name, verbose=False)
        before = _library_mtime(build_dir, name)
        _note_start(name, build_dir, before)
        start = time.monotonic()
        module = jit_load(builder, *args, **kwargs)
        _note_done(name, build_dir, before, time.monotonic() - start)
        return module

    wrapper.dsnd_logged = True  # type: ignore[attr-defined]
    return wrapper


def _without_print(build: Callable[[], Any]) -> Callable[[], Any]:
    """`build()` with what it prints dropped (`logged_jit_load` logs what it did)."""

    @functools.wraps(build)
    def quiet() -> Any:
        with contextlib.redirect_stdout(io.StringIO()):
            return build()

    return quiet


def log_op_builds() -> None:
    """Install `logged_jit_load` on DeepSpeed's op builders and silence the comm layer's
    "built successfully" (once; later calls do nothing)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if not getattr(OpBuilder.jit_load, "dsnd_logged", False):
        OpBuilder.jit_load = logged_jit_load(OpBuilder.jit_load)  # type: ignore[method-assign]
    comm = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is torch
    if not hasattr(comm.build_shm_op, "__wrapped__"):
        comm.build_shm_op = _without_print(comm.build_shm_op)


@contextlib.contextmanager
def quiet_scheduler_start() -> Iterator[None]:
    """DeepSpeed's warmup schedulers' constructor-time warning dropped (see above)."""
    from deepspeed.utils import logger

    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() != SCHEDULER_NOT_STARTED

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def replay_cpu_adam_steps(optimizer: Any, step: int) -> None:
    """Bring a DeepSpeedCPUAdam's C++ beta powers to `step` as `step` uninterrupted steps would
    (see above); any other optimizer is left alone."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam) or step < 1:
        return
    empty = torch.empty(0, dtype=torch.float32)
    for t in range(1, step + 1):
        for group in optimizer.param_groups:  # in the order a step visits them
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(
                optimizer.opt_id,
                t,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                group["bias_correction"],
                empty,
                empty,
                empty,
                empty,
            )


def undo_unfused_init_step(engine: Any) -> None:
    """Undo the zero-gradient optimizer step `FP16_UnfusedOptimizer` takes when it is built (see
    the module docstring); nothing for any other optimizer."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if not isinstance(opt, FP16_UnfusedOptimizer):
        return
    opt.optimizer.state.clear()
    with torch.no_grad():
        for low, masters in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            for param, master in zip(low, masters, strict=True):
                master.copy_(param)


def use_hpz_group(group: dist.ProcessGroup | None) -> None:
    """Make `group` DeepSpeed's ZeRO++ hpZ group (None: none). `deepspeed.zero.Init` takes the
    group as an argument but reads its size and this rank's place in it from the module global
    (`deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP`), and ZeRO-3's optimizer builds
    the global from the whole world when it is unset; a later engine in the process would also
    inherit a stale one. So dsnd sets it before each stage's partitioning."""
    from deepspeed.utils import groups

    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group


def nvme_param_swapper(module: torch.nn.Module) -> Any:
    """The NVMe swapper `deepspeed.zero.Init` gave `module`'s parameters (their `nvme_swapper`),
    or None (no NVMe parameter offload, or no parameters)."""
    return next(
        (
            p.nvme_swapper
            for p in module.parameters()
            if getattr(p, "nvme_swapper", None) is not None
        ),
        None,
    )
