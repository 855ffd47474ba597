"""Model-state bytes a DeepSpeed engine (ZeRO 0-3, fp32 or bf16) holds on this rank, by part.

Counted from the tensors DeepSpeed 0.19.8 keeps (its attribute names, read, never changed):

- params: ZeRO-1: the model's parameters (views into its flat fp32 buffers); ZeRO-3: each
  parameter's `ds_tensor` shard, plus any parameter still gathered whole;
- grads: gradients on the model's parameters (ZeRO-1 accumulates them whole), ZeRO 1-2's reduced
  partitions (`averaged_gradients`) and, for ZeRO-3, the flat buffer of this rank's gradient
  partitions;
- master: the fp32 partitions the optimizer steps (ZeRO-1/2 `single_partition_of_fp32_groups`,
  ZeRO-3 `fp32_partitioned_groups_flat`, bf16 at ZeRO-0 `fp32_groups`; none at ZeRO-0 fp32, where
  the parameters are the masters) and their gradients;
- optimizer: the inner optimizer's per-element state tensors (Adam's `exp_avg` / `exp_avg_sq`,
  SGD's `momentum_buffer`, ...; its scalar step counters are left out).

Memory shared between parts (ZeRO-3's master *is* its parameter shard) is counted once, for the
first part listed. Communication buckets are not model state and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch


def _ranges(tensors: Iterable[torch.Tensor | None]) -> Iterator[tuple[int, int]]:
    for t in tensors:
        if t is not None and t.numel() > 0:
            yield t.data_ptr(), t.numel() * t.element_size()


def _params(engine) -> Iterator[torch.Tensor]:
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            yield p.ds_tensor
        yield p.data  # ZeRO-3: empty unless gathered


def _grads(engine) -> Iterator[torch.Tensor | None]:
    for p in engine.module.parameters():
        yield p.grad
    yield getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    # ZeRO 1-2: the reduced partition the optimizer step reads, kept apart from `.grad`
    averaged = getattr(engine.optimizer, "averaged_gradients", None) or {}
    for tensors in averaged.values() if isinstance(averaged, dict) else averaged:
        yield from tensors or ()


def _masters(engine) -> list[torch.Tensor]:
    opt = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(opt, name):
            return list(getattr(opt, name))
    return [m for group in getattr(opt, "fp32_groups", []) for m in group]


def _optimizer_state(engine) -> Iterator[torch.Tensor]:
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


def claim_bytes(categories: Sequence[tuple[str, Iterable[tuple[int, int]]]]) -> dict[str, int]:
    """Bytes of memory per category, each byte counted once, for the first category naming it.

    Each category lists (address, nbytes) ranges of live tensors. Views share memory (ZeRO-1's
    parameters are views into one flat buffer; ZeRO-3 uses the parameter shard as its master),
    so a range already claimed — by an earlier category or an earlier range — adds nothing.
    """
    claimed: list[tuple[int, int]] = []  # disjoint [start, end), sorted
    out: dict[str, int] = {}
    for name, ranges in categories:
        total = out.get(name, 0)
        for start, nbytes in ranges:
            if nbytes <= 0:
                continue
            total += _claim(claimed, start, start + nbytes)
        out[name] = total
    return out


def _claim(claimed: list[tuple[int, int]], start: int, end: int) -> int:
    """Add [start, end) to the disjoint sorted `claimed`; return how many bytes were new."""
    new = end - start
    merged_start, merged_end = start, end
    keep = []
    for lo, hi in claimed:
        if hi <= start or lo >= end:
            keep.append((lo, hi))
            continue
        new -= min(hi, end) - max(lo, start)
        merged_start, merged_end = min(merged_start, lo), max(merged_end, hi)
    keep.append((merged_start, merged_end))
    keep.sort()
    claimed[:] = keep
    return new


def state_bytes(engine) -> dict[str, int]:
    """{"params", "grads", "master", "optimizer"} -> bytes this rank holds (see the module doc)."""
    masters = _masters(engine)
    return claim_bytes(
        [
            ("params", _ranges(_params(engine))),
            ("grads", _ranges(_grads(engine))),
            ("master", _ranges([*masters, *(m.grad for m in masters)])),
            ("optimizer", _ranges(_optimizer_state(engine))),
        ]
    )
