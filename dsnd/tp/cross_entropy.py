"""Cross-entropy over logits split along the vocabulary (Megatron's vocab-parallel loss).

Rank i holds logits ``z[:, V_i]`` for its contiguous slice ``V_i`` of the padded vocabulary. For
one token with label y, over the real vocabulary (columns >= vocab_size are padding, excluded):

    m = max_j z_j                               all-reduce MAX of the local maxima
    S = sum_j exp(z_j - m)                      all-reduce SUM of the local sums
    t = z_y - m                                 the one rank holding y contributes, others 0
    loss = log S - t
    dloss/dz_j = softmax_j - [j == y] = exp(z_j - m) / S - [j == y]

S and t travel in one all-reduce, so a forward costs two all-reduces of a few floats per token
and the backward none; no rank ever holds more than its own slice of the logits. Tokens whose
label is `ignore_index` add nothing and are left out of the mean, as in F.cross_entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses (0 where ignored) from a vocabulary slice; backward as derived above."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, ignore_index):
        rank = dist.get_rank(group)
        local_vocab = logits.shape[-1]
        start = rank * local_vocab
        z = logits.float()
        if start + local_vocab > vocab_size:  # this slice holds padding columns: known on
            # the host from the shapes, so no `.any()` on a device tensor (a host sync)
            padding = torch.arange(start, start + local_vocab, device=z.device) >= vocab_size
            z = z.masked_fill(padding, float("-inf"))

        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)  # padding stays -inf, its exp 0

        outside = (labels < start) | (labels >= start + local_vocab)
        local = (labels - start).masked_fill(outside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target])
        dist.all_reduce(sums, group=group)
        total, target = sums[0], sums[1]

        ignored = labels == ignore_index
        loss = (total.log() - target).masked_fill(ignored, 0.0)
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside | ignored, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if getattr(ctx, "used", False):
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward per forward")
        ctx.used = True
        softmax, local, not_here, ignored = ctx.saved_tensors
        grad = softmax  # the largest tensor here, saved only for this backward: reuse in place
        # subtract the one-hot of the label on the rank that holds it
        hit = (~not_here).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit)
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over the tokens not labelled `ignore_index`.

    `logits_shard` is ``(..., padded_vocab / tp)``: this rank's contiguous slice of the padded
    vocabulary (as `VocabParallelEmbedding` or a column-parallel head lays it out); `labels` is
    ``(...)`` with global token ids. The result is the same on every rank of `group`.
    """
    losses = _VocabParallelCrossEntropy.apply(logits_shard, labels, group, vocab_size, ignore_index)
    return losses.sum() / (labels != ignore_index).sum()
