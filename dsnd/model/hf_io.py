"""`transformers` checkpoint directories in and out of a pipeline stage, on any layout.

- `load_hf_stage`: before the DeepSpeed engine exists, each rank reads from the directory's
  safetensors only the tensors of the layers its stage holds, and of a tensor-parallel
  parameter only the byte ranges of its own shard (`Shard.take` on a safetensors slice), and
  copies them into its `LayerStack` (under ZeRO-3 one layer gathered at a time, every rank of
  the data-parallel group copying the same values). A borrowing stage of a tied weight holds no
  parameter for it, so reads nothing for it.
- `export_hf`: at the end of a run every stage gathers its parameters (ZeRO-3: one layer at a
  time), one data-parallel replica sends them to global rank 0, which joins the tensor-parallel
  shards (`Shard.combine`, vocabulary padding dropped) and writes them with `write_hf_dir`.
- `write_hf_dir`: full tensors by dsnd name -> HF names, `config.json` and `model.safetensors`,
  which `AutoModelForCausalLM.from_pretrained` loads. A tied weight is written once, under the
  embedding's name (HF ties the head to it). `dsnd ckpt export` uses it too. safetensors 0.8's
  `save_file` writes a private temporary file (mode 0600) and renames it, so the weights came
  out 0600 beside a 0644 config.json; they get the mode the umask gives any new file instead.
"""

from __future__ import annotations

import json
import os

import deepspeed
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsnd.config.presets import ModelDims
from dsnd.errors import UserError
from dsnd.model.hf_config import hf_config
from dsnd.model.hf_weights import hf_layout, to_hf_names
from dsnd.model.specs import LayerStack
from dsnd.tp import Shard
from dsnd.tp.shard import read_part

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _shape_keys(dims: ModelDims) -> list[tuple[tuple[str, ...], int]]:
    """(config.json names, value this run needs) for every shape key."""
    return [
        (("hidden_size", "n_embd"), dims.hidden_size),
        (("num_hidden_layers", "n_layer"), dims.num_layers),
        (("num_attention_heads", "n_head"), dims.num_heads),
        (("num_key_value_heads", "n_head"), dims.num_kv_heads),
        (("vocab_size",), dims.vocab_size),
    ]


def check_hf_config(path: str, dims: ModelDims) -> None:
    """Raise UserError unless `path`/config.json describes the run's model shape."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise UserError(f"model.init_from={path}: cannot read config.json ({e})") from e
    for names, want in _shape_keys(dims):
        key = next((n for n in names if cfg.get(n) is not None), None)
        if key is None:
            raise UserError(f"model.init_from={path}: config.json has no {'/'.join(names)}")
        if int(cfg[key]) != want:
            raise UserError(
                f"model.init_from={path}: config.json {key}={cfg[key]} but the run's model has "
                f"{names[0]}={want}"
            )


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, _WEIGHTS)
    if not os.path.exists(single):
        raise UserError(f"model.init_from={path}: no {_WEIGHTS} or {_INDEX} in the directory")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _modules(stack: LayerStack) -> list[tuple[str, nn.Module]]:
    """(dsnd name prefix, module) for every module of the stage."""
    return [(f"tied_modules.{key}.", m) for key, m in stack.tied_modules.items()] + [
        (f"layers.{index}.", m) for index, m in stack.layers.items()
    ]


def load_hf_stage(stack: LayerStack, path: str, dims: ModelDims) -> None:
    """Copy this stage's parameters from the HF checkpoint directory `path` into `stack`."""
    check_hf_config(path, dims)
    files = _weight_files(path)
    lay = hf_layout(dims)
    for prefix, module in _modules(stack):
        named = list(module.named_parameters())
        if not named:  # e.g. a borrowed tied weight (pipeline/tied.py stripped it)
            continue
        tensors = {}
        for name, param in named:
            hf_name = to_hf_names(prefix + name, dims, lay)[0]
            if hf_name not in files:
                raise UserError(f"model.init_from={path}: the checkpoint has no {hf_name}")
            tensors[name] = _read(files[hf_name], hf_name, param, path)
        params = [p for _, p in named]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for name, param in named:
                param.data.copy_(tensors[name].to(device=param.device, dtype=param.dtype))


def _read(file: str, hf_name: str, param: torch.Tensor, path: str) -> torch.Tensor:
    """`param`'s value from the checkpoint: the whole tensor, or only its tensor-parallel shard."""
    with safe_open(file, framework="pt") as f:
        try:
            return read_part(f.get_slice(hf_name), param)
        except ValueError as e:
            raise UserError(f"model.init_from={path}: {hf_name} {e}") from e


def _join(pieces: list[tuple[torch.Tensor, Shard | None]]) -> torch.Tensor:
    """One full tensor from what the tensor-parallel ranks of one stage sent for it."""
    shard = pieces[0][1]
    if shard is None:  # replicated: every tensor-parallel rank holds the same values
        return pieces[0][0]
    by_rank = {s.rank: value for value, s in pieces}
    return shard.combine([by_rank[r] for r in range(shard.size)]).contiguous()


def write_hf_dir(path: str, dims: ModelDims, tensors: dict[str, torch.Tensor]) -> None:
    """Write full tensors keyed by dsnd name as an HF directory: `config.json` and
    `model.safetensors` (HF names; a tied weight under the embedding's name)."""
    lay = hf_layout(dims)
    named: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        hf_name = to_hf_names(name, dims, lay)[0]  # a tie: the embedding's
        if hf_name in named:
            raise ValueError(f"two dsnd tensors map to the HF name {hf_name!r}")
        named[hf_name] = tensor.detach().to("cpu").contiguous()
    os.makedirs(path, exist_ok=True)
    hf_config(dims).save_pretrained(path)
    weights = os.path.join(path, _WEIGHTS)
    save_file(named, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it (os.umask can only swap it, which would
    race with any other thread creating a file meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:  # no /proc (not Linux)
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def export_hf(stack: nn.Module, path: str, dims: ModelDims, data_group: dist.ProcessGroup) -> None:
    """Write the full model (every stage's parameters) as an HF directory at `path` (rank 0).

    Collective over the world: every rank must call it.
    """
    mine: dict[str, tuple[torch.Tensor, Shard | None]] = {}
    for prefix, module in _modules(stack):
        named = list(module.named_parameters())
        if not named:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in named]):  # no-op below ZeRO-3
            for name, param in named:
                value = param.detach().to("cpu", copy=True).contiguous()
                mine[prefix + name] = (value, getattr(param, "tp_shard", None))
    if dist.get_rank(data_group) != 0:  # one replica per stage sends
        mine = {}
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return
    pieces: dict[str, list[tuple[torch.Tensor, Shard | None]]] = {}
    for part in parts:
        for name, piece in part.items():
            pieces.setdefault(name, []).append(piece)
    write_hf_dir(path, dims, {name: _join(found) for name, found in pieces.items()})
