"""The language-model loss when each context-parallel rank holds a slice of every sequence.

The loss is the mean over all tokens of the micro-batch: L = (Σ_r S_r) / N, S_r the summed
token losses of rank r's slice, N the label count over the group. Gradients are averaged over
the data x context group (`dsnd.distributed.mpu`), i.e. divided by cp as well as dp, so each
rank's loss is its slice's share of L times cp: l_r = cp · S_r / N = cp · mean_r · n_r / N. The
mean of the l_r over the group is L itself, which is also what is reported. N costs one
all-reduce of one number per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def context_parallel_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          group: dist.ProcessGroup,
                          ignore_index: int = -100) -> Callable[..., torch.Tensor]:  # fmt: skip
    """`loss_fn` (a mean over this rank's labels other than `ignore_index`) made this rank's
    share of the mean over the group's whole sequences, times the group size (see above)."""
    size = dist.get_world_size(group)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != ignore_index).sum().to(torch.float32)
        total = count.clone()
        dist.all_reduce(total, group=group)
        if count.item() == 0:  # nothing to learn on this slice (the mean would be NaN)
            return logits.sum() * 0.0
        return loss_fn(logits, labels) * (count * size / total)

    return loss
