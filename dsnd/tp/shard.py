"""Which part of a full (unsplit) tensor a tensor-parallel parameter holds; pure tensor indexing.

A split parameter carries a `Shard` as ``param.tp_shard``. The full tensor is the one a
single-process model (and a `transformers` checkpoint) has; rank r of a group of `size` holds:

- stride 1: the r-th of `size` equal, contiguous chunks along `dim`. When `full_len` does not
  divide (a vocabulary), the full length is padded up to a multiple of `size` first and the
  padding rows are zero: they are never drawn at initialisation, never exported.
- stride k > 1: the full tensor is k equal parts along `dim` (GPT-2's fused q|k|v), and rank r
  holds the r-th chunk of each part, concatenated: ``[q_r | k_r | v_r]``.

`take` reads a shard from a full tensor or from anything indexable like one (a safetensors
slice, so a rank reads only its own bytes); `combine` rebuilds the full tensor from every rank's
shard. Initialisation, Hugging Face import/export and checkpoint reshaping all go through these
two, so a full model is the same whatever the tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    dim: int
    rank: int
    size: int
    full_len: int  # the full tensor's length along `dim` (before any padding)
    stride: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} not in a group of {self.size}")
        if self.stride > 1 and self.full_len % (self.stride * self.size):
            raise ValueError(
                f"{self.full_len} does not split into {self.stride} parts of {self.size} chunks"
            )

    @property
    def padded_len(self) -> int:
        return -(-self.full_len // self.size) * self.size

    @property
    def local_len(self) -> int:
        return self.padded_len // self.size

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_len
        return tuple(shape)

    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) ranges along `dim` of the full tensor, in the order the shard holds them
        (padding excluded: the shard's tail beyond them is zero)."""
        part = self.padded_len // self.stride  # one of the stride parts, padded
        chunk = part // self.size
        out = []
        for p in range(self.stride):
            start = p * part + self.rank * chunk
            end = min(start + chunk, self.full_len)
            if end > start:
                out.append((start, end))
        return out

    def take(self, full: Any) -> torch.Tensor:
        """This rank's shard of `full` (a tensor, or a safetensors slice of one)."""
        lead = (slice(None),) * self.dim
        pieces = [full[(*lead, slice(s, e))] for s, e in self.ranges()]
        out = torch.cat(pieces, dim=self.dim) if pieces else None
        have = 0 if out is None else out.shape[self.dim]
        if have < self.local_len:  # the padded tail of a vocabulary
            shape = list(
                self.full_shape(full.get_shape() if hasattr(full, "get_shape") else full.shape)
            )
            shape[self.dim] = self.local_len - have
            dtype = out.dtype if out is not None else torch.float32
            pad = torch.zeros(shape, dtype=dtype, device=out.device if out is not None else "cpu")
            out = pad if out is None else torch.cat([out, pad], dim=self.dim)
        return out

    def combine(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (`shards[r]` from rank r), padding dropped."""
        if len(shards) != self.size:
            raise ValueError(f"{len(shards)} shards for a group of {self.size}")
        parts = []
        for r, shard in enumerate(shards):
            mine = Shard(self.dim, r, self.size, self.full_len, self.stride)
            offset = 0
            for start, end in mine.ranges():
                parts.append((start, shard.narrow(self.dim, offset, end - start)))
                offset += end - start
        parts.sort(key=lambda item: item[0])
        return torch.cat([p for _, p in parts], dim=self.dim)


def read_part(stored: Any, param: torch.Tensor, local: tuple[int, ...]) -> torch.Tensor:
    """`param`'s part of a stored full tensor `stored` (a safetensors slice from
    ``safe_open(...).get_slice(name)``): its tensor-parallel shard, or all of it. Only those
    bytes are read. `local` is `param`'s shape on this rank before ZeRO-3 partitioned it (the
    engine's `unpartitioned_shape`). ValueError when the stored shape is not the full shape."""
    shard = getattr(param, "tp_shard", None)
    want = shard.full_shape(local) if shard is not None else local
    have = tuple(stored.get_shape())
    if have != want:
        raise ValueError(f"has shape {have}, the model needs {want}")
    return shard.take(stored) if shard is not None else stored[:]
