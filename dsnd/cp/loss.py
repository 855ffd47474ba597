"""The language-model loss when each context-parallel rank holds a slice of every sequence.

The loss is the mean over all tokens of the micro-batch: L = (Σ_r S_r) / N, S_r the summed
token losses of rank r's slice, N the label count over the group. Gradients are averaged over
the data x context group (`dsnd.distributed.mpu`), i.e. divided by cp as well as dp, so each
rank's loss is its slice's share of L times cp: l_r = cp · S_r / N = cp · mean_r · n_r / N. The
mean of the l_r over the group is L itself, which is also what is reported. N costs one
all-reduce of one number per micro-batch, and nothing is read back to the host: a slice without
labels (n_r = 0) is handled on the device (`_never_empty`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def context_parallel_loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    ignore_index: int = -100,
) -> Callable[..., torch.Tensor]:
    """`loss_fn` (a mean over this rank's labels other than `ignore_index`) made this rank's
    share of the mean over the group's whole sequences, times the group size (see above)."""
    size = dist.get_world_size(group)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != ignore_index).sum().to(torch.float32)
        total = count.clone()
        dist.all_reduce(total, group=group)
        scale = count * size / total.clamp(min=1)
        return loss_fn(logits, _never_empty(labels, count)) * scale

    return loss


def _never_empty(labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """`labels`, or where none of them counts (`count` 0) the same with the first one set to
    token 0, chosen on the device: no host sync per micro-batch.

    A slice without labels would make `loss_fn`'s mean 0/0 = NaN, and NaN x 0 is NaN in the
    value and in every gradient. With one stand-in label the mean is finite, and the slice's
    `scale` = cp · n_r / N = 0 makes its loss 0 and its gradients exactly 0, as a constant
    0 would; a slice with labels is passed on untouched."""
    first = labels.reshape(-1)[:1]
    stand_in = torch.cat([torch.zeros_like(first), labels.reshape(-1)[1:]]).view_as(labels)
    return torch.where(count > 0, labels, stand_in)
