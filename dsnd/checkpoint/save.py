"""Save a checkpoint of every stage (collective over the world), committed atomically.

Per stage, rank (dp 0, tp 0) writes one model file and one optimizer file per global layer it
holds (full tensors, joined over data- and tensor-parallel peers); every rank writes its RNG
file; rank 0 then writes the manifest and commits (dsnd/checkpoint/commit.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import platform
import shutil
import signal

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save as safetensors_bytes

from dsnd import __version__
from dsnd.checkpoint import rng
from dsnd.checkpoint.commit import prune, publish, temporary_dir, write_atomic, write_manifest
from dsnd.checkpoint.failure import agree, attempt
from dsnd.checkpoint.files import FORMAT, model_file, optim_file, rng_file, step_dir_name
from dsnd.config.resolve import Resolved
from dsnd.data.blend import BlendedCorpus
from dsnd.data.corpus import Corpus
from dsnd.distributed.groups import ProcessGroups
from dsnd.engine.loss_scale import scaler_state
from dsnd.engine.public import version as deepspeed_version
from dsnd.engine.state import full_state, optim_keys, optimizer_step
from dsnd.errors import Diverged
from dsnd.model.stack import layer_of
from dsnd.secrets import mask_config

# the dtype names safetensors writes in its header (the manifest records what it wrote)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# Test hooks (tests/integration): "STEP:RANK" makes that rank SIGKILL itself in the middle of
# that step's save, after writing its own files and before the commit (FAULT_ENV), find its
# disk full (ENOSPC) when it starts writing them (FULL_DISK_ENV), so that the launcher's
# diagnosis of which rank failed first can be checked against the rank that really did, or
# send itself SIGINT twice there (SIGINT_ENV: Ctrl-C pressed twice while a save is under way).
FAULT_ENV = "DSND_FAULT_KILL_IN_SAVE"
FULL_DISK_ENV = "DSND_FAULT_FULL_DISK_IN_SAVE"
SIGINT_ENV = "DSND_FAULT_SIGINT_IN_SAVE"


def _fault_point(step: int, env: str, tmp: str) -> None:
    if os.environ.get(env) != f"{step}:{dist.get_rank()}":
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
        "config": mask_config({"run": dataclasses.asdict(res.run), "deepspeed": res.ds}),
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


def _all_finite(finite: bool, device) -> bool:
    """True on every rank when `finite` is True on every rank (collective)."""
    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


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
    name = step_dir_name(step)
    tmp = temporary_dir(root, name)
    rank = dist.get_rank()
    failed = attempt(lambda: _fresh(tmp))[1] if rank == 0 else None
    dist.barrier()
    keys, layers, params, finite = _own_state(engine, groups)
    if not _all_finite(finite, engine.device):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise Diverged(
            f"step {step}: the model or optimizer state holds NaN or infinite values; "
            "not saved (the last committed checkpoint stays latest)"
        )
    files: list[str] | None = None
    if failed is None:
        files, failed = attempt(lambda: _write_own(step, tmp, rank, layers))
    agree(failed, root, tmp, name, engine.device)
    everyone: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((files, params), everyone, dst=0)
    final = None
    if everyone is not None:
        all_files = sorted(f for fs, _ in everyone for f in fs)
        all_params = {k: v for _, ps in everyone for k, v in ps.items()}
        manifest = _manifest(res, engine, step, corpus, all_params, keys, job_id)
        final, failed = attempt(
            lambda: _commit(tmp, manifest, all_files, root, name, res.run.checkpoint.keep)
        )
    agree(failed, root, tmp, name, engine.device)  # nobody moves on before the commit
    return final


def _fresh(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _own_state(engine, groups: ProcessGroups) -> tuple[list, dict, dict, bool]:
    """(the optimizer's state keys, {layer: (model tensors, optimizer tensors)} and the
    manifest's params this rank writes, whether every value is finite). Collective: one rank
    per stage writes; the others hold the same (gathered) tensors."""
    writer = groups.coord.dp == 0 and groups.coord.tp == 0 and groups.coord.cp == 0
    keys = optim_keys(engine)
    layers: dict[int, tuple[dict, dict]] = {}
    params: dict[str, dict] = {}
    finite = True
    for pname, value, states in full_state(engine, engine.module, keys, groups.tensor):
        finite = finite and all(bool(torch.isfinite(t).all()) for t in (value, *states.values()))
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
    return keys, layers, params, finite


def _write_own(step: int, tmp: str, rank: int, layers: dict) -> list[str]:
    """This rank's files of the checkpoint (its layers' tensors, its RNG state) in `tmp`."""
    _fault_point(step, FULL_DISK_ENV, tmp)
    files = []
    for layer, (model, optim) in sorted(layers.items()):
        files.append(_write_tensors(tmp, model_file(layer), model))
        if optim:
            files.append(_write_tensors(tmp, optim_file(layer), optim))
    write_atomic(os.path.join(tmp, rng_file(rank)), json.dumps(rng.capture()).encode())
    files.append(rng_file(rank))
    _fault_point(step, SIGINT_ENV, tmp)
    _fault_point(step, FAULT_ENV, tmp)
    return files


def _commit(tmp: str, manifest: dict, files: list[str], root: str, name: str, keep: int) -> str:
    """Rank 0: the manifest, then the rename that commits and `latest`, then the rotation."""
    write_manifest(tmp, manifest, files)
    final = publish(root, tmp, name)
    prune(root, keep)
    return final
