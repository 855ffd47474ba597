"""Save a checkpoint of every stage (collective over the world), committed atomically.

Per stage, rank (dp 0, tp 0) writes one model file and one optimizer file per global layer it
holds (full tensors, joined over data- and tensor-parallel peers); every rank writes its RNG
file; rank 0 then writes the manifest and commits (dsnd/checkpoint/commit.py). With
`checkpoint.async` the writes and the commit happen on a background thread
(`start_async_save`; the protocol is in dsnd/checkpoint/async_writer.py), with the same files.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import platform
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save as safetensors_bytes

from dsnd import __version__
from dsnd.checkpoint import rng
from dsnd.checkpoint.async_writer import AsyncWriter, HostCopies, Job, finite_flag
from dsnd.checkpoint.commit import prune, publish, temporary_dir, write_atomic, write_manifest
from dsnd.checkpoint.failure import agree, attempt
from dsnd.checkpoint.files import FORMAT, model_file, optim_file, rng_file, step_dir_name
from dsnd.config.resolve import Resolved
from dsnd.config.strict import as_data
from dsnd.data.blend import BlendedCorpus
from dsnd.data.corpus import Corpus
from dsnd.distributed.groups import ProcessGroups
from dsnd.engine.loss_scale import scaler_state
from dsnd.engine.public import version as deepspeed_version
from dsnd.engine.state import full_state, optim_keys, optimizer_step
from dsnd.errors import Diverged
from dsnd.model.stack import layer_of
from dsnd.secrets import mask_config

log = logging.getLogger(__name__)

# the dtype names safetensors writes in its header (the manifest records what it wrote)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# Test hooks (tests/integration): "STEP:RANK" makes that rank SIGKILL itself in the middle of
# that step's save, after writing its own files and before the commit (FAULT_ENV), find its
# disk full (ENOSPC) when it starts writing them (FULL_DISK_ENV), so that the launcher's
# diagnosis of which rank failed first can be checked against the rank that really did, or
# send itself SIGINT twice there (SIGINT_ENV: Ctrl-C pressed twice while a save is under way).
# With checkpoint.async they fire on the writer thread. "SECONDS" makes every asynchronous
# save's writer sleep that long before it writes (SLOW_ASYNC_ENV: a write still in flight when
# a signal comes).
FAULT_ENV = "DSND_FAULT_KILL_IN_SAVE"
FULL_DISK_ENV = "DSND_FAULT_FULL_DISK_IN_SAVE"
SIGINT_ENV = "DSND_FAULT_SIGINT_IN_SAVE"
SLOW_ASYNC_ENV = "DSND_FAULT_SLOW_ASYNC_WRITE"


def _fault_point(step: int, env: str, tmp: str, rank: int) -> None:
    if os.environ.get(env) != f"{step}:{rank}":
        return
    if env == FAULT_ENV:
        os.kill(os.getpid(), signal.SIGKILL)
    if env == SIGINT_ENV:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
        return
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)


def _write_tensors(step_dir: str, name: str, tensors: dict[str, torch.Tensor]) -> str:
    write_atomic(os.path.join(step_dir, name), safetensors_bytes(tensors))
    return name


def software_versions() -> dict[str, str]:
    """What wrote a checkpoint (the manifest's "versions")."""
    return {
        "dsnd": __version__,
        "deepspeed": deepspeed_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _manifest(
    res: Resolved,
    engine,
    step: int,
    corpus: Corpus | BlendedCorpus,
    params: dict,
    keys: list,
    job_id: str | None,
) -> dict:
    sched = engine.lr_scheduler
    group = engine.optimizer.param_groups[0]
    return {
        "format": FORMAT,
        "step": step,
        "job_id": job_id,
        "consumed_samples": step * res.batch.train,
        "topology": {
            "pp": res.topology.pp,
            "tp": res.topology.tp,
            "dp": res.topology.dp,
            "cp": res.topology.cp,
            "world_size": res.topology.world_size,
        },
        "zero_stage": res.plan.zero_stage,
        "parts": list(res.plan.parts),
        "model": res.model.manifest(),
        "versions": software_versions(),
        "config": mask_config({"run": as_data(res.run), "deepspeed": res.ds}),
        "corpus": corpus.manifest(),  # name, tokens, sha256 (a blend: each file's too)
        "trainer": {
            "optimizer_step": optimizer_step(engine),
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "lr": group["lr"],
            "betas": list(group["betas"]) if "betas" in group else None,
            "loss_scaler": scaler_state(engine),
        },
        "params": params,
        "optim_keys": keys,
    }


def _all_finite(finite: bool | torch.Tensor, device) -> bool:
    """True on every rank when `finite` is True on every rank (collective)."""
    if isinstance(finite, bool):
        flag = torch.tensor([1.0 if finite else 0.0], device=device)
    else:
        flag = finite.to(device=device, dtype=torch.float32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


@dataclass(frozen=True)
class _At:
    """Where one save goes: step N's directory `name` under `root`, written as `tmp` first."""

    step: int
    root: str
    name: str
    tmp: str
    rank: int


def _at(step: int, root: str) -> _At:
    name = step_dir_name(step)
    return _At(step, root, name, temporary_dir(root, name), dist.get_rank())


def save_checkpoint(
    engine,
    res: Resolved,
    groups: ProcessGroups,
    step: int,
    root: str,
    corpus: Corpus | BlendedCorpus,
    job_id: str | None = None,
) -> str | None:
    """Write and commit `root/step_<step>`; returns its path on rank 0 (None elsewhere).

    A state holding NaN or infinity is never committed: Diverged on every rank instead, the
    temporary directory removed and `latest` untouched. A write the filesystem refuses (a full
    disk) on any rank is `WriteFailed` on every rank, with the same outcome
    (`dsnd.checkpoint.failure`)."""
    at = _at(step, root)
    failed = _prepare(at)
    keys, layers, params = _finite_state(engine, groups, at, None)
    files: list[str] | None = None
    if failed is None:
        state = rng.capture()
        files, failed = attempt(lambda: _write_own(at, layers, state))
    agree(failed, root, at.tmp, at.name, engine.device)
    everyone = _gather_files(files, params)
    final = None
    if everyone is not None:
        final, failed = attempt(_committer(res, engine, at, corpus, keys, job_id, everyone))
    agree(failed, root, at.tmp, at.name, engine.device)  # nobody moves on before the commit
    return final


def start_async_save(
    engine,
    res: Resolved,
    groups: ProcessGroups,
    at: _At,
    corpus: Corpus | BlendedCorpus,
    job_id: str | None,
    writer: AsyncWriter,
) -> None:
    """The collective part of an asynchronous save, on the training thread; then `writer`'s
    thread writes this rank's files and (rank 0) commits once every rank's are on disk
    (dsnd/checkpoint/async_writer.py). The previous save must have been joined."""
    agree(_prepare(at), at.root, at.tmp, at.name, engine.device)
    copies = HostCopies(engine.device, keep=_writes(groups))
    keys, layers, params = _finite_state(engine, groups, at, copies)
    everyone = _gather_files(_own_files(at.rank, layers), params)
    commit = None
    if everyone is not None:
        commit = _committer(res, engine, at, corpus, keys, job_id, everyone)
    state, ready = rng.capture(), copies.ready()
    writer.start(
        Job(at.name, at.tmp, at.root, lambda: _write_later(at, layers, state, ready), commit)
    )


def finish_async_save(writer: AsyncWriter, device) -> str | None:
    """Collective: join the save in flight and agree whether every rank wrote it (WriteFailed
    on every rank if not, as `save_checkpoint`); its committed path on rank 0, else None."""
    job = writer.wait()
    if job is None:
        return None
    agree(job.error, job.root, job.tmp, job.name, device)
    return job.final


def _write_later(at: _At, layers: dict, state: dict, ready: Callable[[], None]) -> None:
    """An asynchronous save's writes, on the writer thread: no torch.distributed call here."""
    ready()
    slow = os.environ.get(SLOW_ASYNC_ENV)
    if slow:
        time.sleep(float(slow))
    _write_own(at, layers, state)


def _prepare(at: _At) -> OSError | None:
    """Rank 0 makes the empty temporary directory (what it failed with); every rank waits."""
    failed = attempt(lambda: _fresh(at.tmp))[1] if at.rank == 0 else None
    dist.barrier()
    return failed


def _finite_state(engine, groups: ProcessGroups, at: _At, copies: HostCopies | None):
    """(optimizer keys, layers, params) of `_own_state`; Diverged on every rank (collective)
    when any value is not finite."""
    keys, layers, params, finite = _own_state(engine, groups, copies)
    if not _all_finite(finite, engine.device):
        if at.rank == 0:
            shutil.rmtree(at.tmp, ignore_errors=True)
        raise Diverged(
            f"step {at.step}: the model or optimizer state holds NaN or infinite values; "
            "not saved (the last committed checkpoint stays latest)"
        )
    return keys, layers, params


def _gather_files(files: list[str] | None, params: dict) -> list | None:
    """Every rank's (files, params) on rank 0 (None elsewhere; collective)."""
    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((files, params), everyone, dst=0)
    return everyone


def _committer(
    res: Resolved, engine, at: _At, corpus, keys: list, job_id: str | None, everyone: list
) -> Callable[[], str]:
    """Rank 0: the commit of this save, with its manifest's contents taken now, at the step."""
    all_files = sorted(f for fs, _ in everyone for f in fs)
    all_params = {k: v for _, ps in everyone for k, v in ps.items()}
    manifest = _manifest(res, engine, at.step, corpus, all_params, keys, job_id)
    manifest = copy.deepcopy(manifest)  # nothing in it moves with the training that goes on
    keep = res.run.checkpoint.keep
    return lambda: _commit(at.tmp, manifest, all_files, at.root, at.name, keep)


def _fresh(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _writes(groups: ProcessGroups) -> bool:
    """Whether this rank writes its stage's tensors (one rank per stage does)."""
    return groups.coord.dp == 0 and groups.coord.tp == 0 and groups.coord.cp == 0


def _own_state(
    engine, groups: ProcessGroups, copies: HostCopies | None
) -> tuple[list, dict, dict, bool | torch.Tensor]:
    """(the optimizer's state keys, {layer: (model tensors, optimizer tensors)} and the
    manifest's params this rank writes, whether every value is finite: a bool, or `copies`'s
    flag when it takes the copies). Collective: one rank per stage writes; the others hold the
    same (gathered) tensors."""
    writer = _writes(groups)
    keys = optim_keys(engine)
    layers: dict[int, tuple[dict, dict]] = {}
    params: dict[str, dict] = {}
    finite = True
    for pname, value, states in full_state(engine, engine.module, keys, groups.tensor, copies):
        if copies is None:
            finite = finite and all(bool(finite_flag(t)) for t in (value, *states.values()))
        if writer:
            layer = layer_of(pname, engine.module)
            model, optim = layers.setdefault(layer, ({}, {}))
            model[pname] = value.contiguous()
            optim.update({f"{pname}.{k}": v.contiguous() for k, v in states.items()})
            params[pname] = {
                "file": model_file(layer),
                "shape": list(value.shape),
                "dtype": SAFETENSORS_DTYPES[value.dtype],
            }
    return keys, layers, params, finite if copies is None else copies.finite


def _own_files(rank: int, layers: dict) -> list[str]:
    """The names of the files `_write_own` writes, known before it writes them."""
    files = []
    for layer, (_, optim) in sorted(layers.items()):
        files.append(model_file(layer))
        if optim:
            files.append(optim_file(layer))
    return [*files, rng_file(rank)]


def _write_own(at: _At, layers: dict, rng_state: dict) -> list[str]:
    """This rank's files of the checkpoint (its layers' tensors, its RNG state) in `at.tmp`."""
    _fault_point(at.step, FULL_DISK_ENV, at.tmp, at.rank)
    files = []
    for layer, (model, optim) in sorted(layers.items()):
        files.append(_write_tensors(at.tmp, model_file(layer), model))
        if optim:
            files.append(_write_tensors(at.tmp, optim_file(layer), optim))
    write_atomic(os.path.join(at.tmp, rng_file(at.rank)), json.dumps(rng_state).encode())
    files.append(rng_file(at.rank))
    _fault_point(at.step, SIGINT_ENV, at.tmp, at.rank)
    _fault_point(at.step, FAULT_ENV, at.tmp, at.rank)
    return files


def _commit(tmp: str, manifest: dict, files: list[str], root: str, name: str, keep: int) -> str:
    """Rank 0: the manifest, then the rename that commits and `latest`, then the rotation."""
    write_manifest(tmp, manifest, files)
    final = publish(root, tmp, name)
    prune(root, keep)
    return final


class Saver:
    """The trainer's saves: each committed before training goes on, or with `checkpoint.async`
    written in the background (one in flight, joined at the next save and at the end)."""

    def __init__(
        self,
        res: Resolved,
        groups: ProcessGroups,
        root: str,
        corpus: Corpus | BlendedCorpus,
        job_id: str | None,
    ) -> None:
        self.res, self.groups, self.root, self.corpus, self.job_id = (
            res,
            groups,
            root,
            corpus,
            job_id,
        )
        self.writer = None
        if res.run.checkpoint.async_:
            self.writer = AsyncWriter(
                dist.get_rank(), dist.get_world_size(), res.run.dist.timeout_s
            )

    def save(self, engine, step: int) -> str | None:
        """Save at `step` (collective); on rank 0 the checkpoint committed by now (the new one,
        or when asynchronous the previous one, if any), else None."""
        if self.writer is None:
            saved = save_checkpoint(
                engine, self.res, self.groups, step, self.root, self.corpus, self.job_id
            )
            if saved:
                log.info("checkpoint %s committed", saved)
            return saved
        previous = self.finish(engine)
        at = _at(step, self.root)
        start_async_save(engine, self.res, self.groups, at, self.corpus, self.job_id, self.writer)
        return previous

    def finish(self, engine) -> str | None:
        """Collective: the save in flight joined and agreed on (`finish_async_save`)."""
        return None if self.writer is None else finish_async_save(self.writer, engine.device)

    def close(self) -> None:
        """Whatever happened, before the engine goes: the save in flight finishes on this rank
        (no collective: a peer may be gone; rank 0 commits if every rank's files arrive)."""
        if self.writer is not None:
            self.writer.wait()
