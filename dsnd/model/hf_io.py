"""`transformers` checkpoint directories in and out of a pipeline stage, on any layout.

- `load_hf_stage`: before the DeepSpeed engine exists, each rank reads from the directory's
  safetensors only the tensors of the layers its stage holds, and of a tensor-parallel
  parameter only the byte ranges of its own shard (`Shard.take` on a safetensors slice), and
  copies them into its `LayerStack` (under ZeRO-3 one layer gathered at a time, every rank of
  the data-parallel group copying the same values). A borrowing stage of a tied weight holds no
  parameter for it, so reads nothing for it.
- `export_hf` (`dsnd.model.hf_export`): at the end of a run the stages stream their parameters
  one tensor at a time to global rank 0, which joins the shards and writes the same files as
  `write_hf_dir` (sharing `write_config` and `copy_tokenizer`).
- Mixture-of-experts weights are stored in files one tensor per expert, as `save_pretrained`
  writes them, and fused in memory (`dsnd.model.hf_files`); both directions convert.
- `write_hf_dir`: full tensors by dsnd name -> HF names, `config.json` and `model.safetensors`,
  which `AutoModelForCausalLM.from_pretrained` loads, written whole beside the target and renamed
  into place, over nothing but the same run's earlier export (`dsnd.model.export_dir`). A tied
  weight is written once, under the embedding's name (HF ties the head to it). `dsnd ckpt
  export` uses it too. safetensors 0.8's `save_file` writes a private temporary file (mode 0600)
  and renames it, so the weights came out 0600 beside a 0644 config.json; they get the mode the
  umask gives any new file instead.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.engine.public import gathered_parameters
from dsnd.errors import UserError
from dsnd.fs import umask
from dsnd.model.count import full_shapes
from dsnd.model.export_dir import ExportOrigin, write_whole
from dsnd.model.hf_files import file_names, file_shapes, join, split
from dsnd.model.hf_weights import from_hf_name, to_hf_names
from dsnd.model.moe_config import num_experts
from dsnd.model.source import ModelSpec, load_model, tokenizer_files
from dsnd.model.stack import LayerStack
from dsnd.tp.shard import read_part

WEIGHTS = "model.safetensors"
WEIGHTS_METADATA = {"format": "pt"}
_INDEX = "model.safetensors.index.json"


def check_init_from(path: str, model: ModelSpec) -> None:
    """Raise UserError (one line) unless the HF directory `path` holds exactly `model`: its
    config.json describes the same network (every value that changes the math), and its
    weights hold every tensor of the model with its full shape and nothing else. Reads only
    config.json and the safetensors headers."""
    key = "model.init_from"
    theirs = load_model(path, key)
    mine_math, their_math = model.math(), theirs.math()
    for name in sorted(set(mine_math) | set(their_math)):
        if mine_math.get(name) != their_math.get(name):
            raise UserError(
                f"{key}={path}: config.json {name}={their_math.get(name)!r} but "
                f"the run's model ({model.source}) has {mine_math.get(name)!r}"
            )
    files = _weight_files(path)
    shapes = _header_shapes(files)
    # a tied weight under its first HF name (the embedding's), as save_pretrained writes it;
    # experts one tensor each (`hf_files`)
    experts = model.family.names.experts
    want = {
        file: part
        for name, shape in full_shapes(model).items()
        for file, part in file_shapes(to_hf_names(name, model)[0], shape, experts).items()
    }
    for hf_name, shape in want.items():
        if hf_name not in shapes:  # also a name the index lists in a file that lacks it
            raise UserError(f"{key}={path}: the checkpoint has no {hf_name} (shape {list(shape)})")
        have = shapes[hf_name]
        if have != shape:
            raise UserError(
                f"{key}={path}: {hf_name} has shape {list(have)} but the model's is {list(shape)}"
            )
    for hf_name in sorted(files):
        if hf_name not in want and _must_be_the_models(hf_name, model):
            raise UserError(f"{key}={path}: the checkpoint has {hf_name}, which the model has not")


def _must_be_the_models(hf_name: str, model: ModelSpec) -> bool:
    """Whether a checkpoint's tensor `hf_name` has to be one of `model`'s: not for buffers dsnd
    recomputes (rotary frequencies) nor a tied head's copy, which checkpoints may carry."""
    try:
        return from_hf_name(hf_name, model) is not None
    except KeyError:  # not a tensor of this family at all
        return True


def _header_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the headers (each safetensors file opened once)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, WEIGHTS)
    if not os.path.exists(single):
        raise UserError(f"model.init_from={path}: no {WEIGHTS} or {_INDEX} in the directory")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _modules(stack: LayerStack) -> list[tuple[str, nn.Module]]:
    """(dsnd name prefix, module) for every module of the stage."""
    return [(f"tied_modules.{key}.", m) for key, m in stack.tied_modules.items()] + [
        (f"layers.{index}.", m) for index, m in stack.layers.items()
    ]


def load_hf_stage(stack: LayerStack, path: str, model: ModelSpec) -> None:
    """Copy this stage's parameters from the HF checkpoint directory `path` into `stack`
    (`check_init_from` has checked names and shapes before start)."""
    files = _weight_files(path)
    for prefix, module in _modules(stack):
        named = list(module.named_parameters())
        if not named:  # e.g. a borrowed tied weight (pipeline/tied.py stripped it)
            continue
        tensors = {
            name: _read_param(files, to_hf_names(prefix + name, model)[0], param, path, model)
            for name, param in named
        }
        params = [p for _, p in named]
        with gathered_parameters(params, modifier_rank=0), torch.no_grad():
            for name, param in named:
                param.data.copy_(tensors[name].to(device=param.device, dtype=param.dtype))


def _read_param(
    files: dict[str, str], hf_name: str, param: torch.Tensor, path: str, model: ModelSpec
) -> torch.Tensor:
    """`param` (HF name `hf_name` in memory) from the file tensors that hold it (`hf_files`:
    a fused expert weight from one tensor per expert; MoE blocks are not split over
    tensor-parallel ranks, and with expert parallelism only this rank's experts are read)."""
    experts = model.family.names.experts
    names = file_names(hf_name, experts, num_experts(model.config) if experts else 0)
    for name in names:
        if name not in files:
            raise UserError(f"model.init_from={path}: the checkpoint has no {name}")
    if names == [hf_name]:
        return _read(files[hf_name], hf_name, param, path)
    shard = getattr(param, "tp_shard", None)
    if shard is not None:  # this expert-parallel rank's experts (`dsnd.moe`: dim 0)
        ((start, end),) = shard.ranges()
        per_expert = len(names) // shard.full_len
        names = names[start * per_expert : end * per_expert]
    with contextlib.ExitStack() as opened:  # each file opened once for all of its experts
        handles = {
            file: opened.enter_context(safe_open(file, framework="pt"))
            for file in dict.fromkeys(files[name] for name in names)
        }
        parts = [handles[files[name]].get_tensor(name) for name in names]
    return join(hf_name, parts, experts)


def _read(file: str, hf_name: str, param: torch.Tensor, path: str) -> torch.Tensor:
    """`param`'s value from the checkpoint: the whole tensor, or only its tensor-parallel shard."""
    with safe_open(file, framework="pt") as f:
        try:
            return read_part(f.get_slice(hf_name), param, unpartitioned_shape(param))
        except ValueError as e:
            raise UserError(f"model.init_from={path}: {hf_name} {e}") from e


def write_hf_dir(
    path: str,
    model: ModelSpec,
    tensors: dict[str, torch.Tensor],
    tokenizer_from: str | None = None,
    origin: ExportOrigin | None = None,
    where: str | None = None,
) -> dict | None:
    """Write full tensors keyed by dsnd name as an HF directory: `config.json` (the model's
    full config, architectures set), `model.safetensors` (HF names; a tied weight under the
    embedding's name), and the tokenizer files of `tokenizer_from` when it has any, with the
    marker of `origin`'s run, replacing only that run's earlier export (`export_dir`; refusals
    start with `where`, default `path`). Returns the replaced export's marker (None: none)."""
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        hf_name = to_hf_names(name, model)[0]  # a tie: the embedding's
        for file_name, part in split(
            hf_name, tensor.detach().to("cpu"), model.family.names.experts
        ).items():
            if file_name in named:
                raise ValueError(f"two dsnd tensors map to the HF name {file_name!r}")
            named[file_name] = part.contiguous()
    return write_whole(
        path,
        origin or ExportOrigin(None, None),
        lambda tmp: _write_files(tmp, model, named, tokenizer_from),
        where,
    )


def _write_files(
    path: str, model: ModelSpec, named: dict[str, torch.Tensor], tokenizer_from: str | None
) -> None:
    # the dtype the tensors are written in (a bf16 model directory trained in fp32 exports fp32:
    # its config must not tell from_pretrained to cast them back down)
    write_config(path, model, next(iter(named.values())).dtype)
    weights = os.path.join(path, WEIGHTS)
    save_file(named, weights, metadata=WEIGHTS_METADATA)
    os.chmod(weights, 0o666 & ~umask())
    copy_tokenizer(path, tokenizer_from)


def write_config(path: str, model: ModelSpec, dtype: torch.dtype) -> None:
    """`config.json` of an export whose tensors are `dtype`, naming the family's class."""
    config = copy.deepcopy(model.config)
    config.architectures = [model.family.architectures[0]]
    config.dtype = dtype
    config.save_pretrained(path)


def copy_tokenizer(path: str, tokenizer_from: str | None) -> None:
    """The tokenizer files `tokenizer_from` holds (`tokenizer_files`; none: nothing) into the
    export `path`: a model trained from its own export keeps its chat template."""
    for name in tokenizer_files(tokenizer_from):
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        shutil.copyfile(os.path.join(tokenizer_from, name), os.path.join(path, name))
