"""Model-state bytes a ZeRO-1 or ZeRO-3 DeepSpeed engine holds on this rank, by part.

Counted from the tensors DeepSpeed 0.19.8 keeps (its attribute names, read, never changed):

- params: ZeRO-1: the model's parameters (views into its flat fp32 buffers); ZeRO-3: each
  parameter's `ds_tensor` shard, plus any parameter still gathered whole;
- grads: gradients on the model's parameters (ZeRO-1 accumulates them whole) and, for ZeRO-3,
  the flat buffer of this rank's gradient partitions;
- master: the fp32 partitions the optimizer steps (ZeRO-1 `single_partition_of_fp32_groups`,
  ZeRO-3 `fp32_partitioned_groups_flat`) and their gradients;
- adam: the inner optimizer's `exp_avg` / `exp_avg_sq` state.

Memory shared between parts (ZeRO-3's master *is* its parameter shard) is counted once, for the
first part listed. Communication buckets are not model state and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from dsnd.bench.results import claim_bytes

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


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


def _masters(engine) -> list[torch.Tensor]:
    opt = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(opt, name):
            return list(getattr(opt, name))
    raise TypeError(f"{type(opt).__name__} is not a ZeRO-1/2/3 optimizer this bench knows")


def _adam(engine) -> Iterator[torch.Tensor]:
    inner = engine.optimizer.optimizer
    for state in inner.state.values():
        for key in ADAM_KEYS:
            if key in state:
                yield state[key]


def state_bytes(engine) -> dict[str, int]:
    """{"params", "grads", "master", "adam"} -> bytes this rank holds (see the module doc)."""
    masters = _masters(engine)
    return claim_bytes(
        [
            ("params", _ranges(_params(engine))),
            ("grads", _ranges(_grads(engine))),
            ("master", _ranges([*masters, *(m.grad for m in masters)])),
            ("adam", _ranges(_adam(engine))),
        ]
    )
