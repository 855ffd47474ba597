"""Ring attention: causal attention over a sequence whose slices live on the ranks of a
context-parallel group, keys and values passing around the ring.

Each rank holds sequence chunks i and 2*cp-1-i (`dsnd.cp.slices`) of its queries, keys and
values. In step j of cp, rank r holds the keys/values of rank (r - j) mod cp, attends its query
chunks to them blockwise, and meanwhile sends them on to rank r+1 and receives the next ones
from rank r-1 (asynchronous point-to-point, overlapped with the block's arithmetic). Block
(query chunk a, key chunk b) of the global causal mask is full when b < a, triangular when
b == a, empty when b > a.

Blocks combine by the online softmax, in fp32: each block gives its normalised output o_b and
log-sum-exp l_b per query, and (o, l) ← (o·e^(l−l') + o_b·e^(l_b−l'), l' = logaddexp(l, l_b)).
Only q, k, v, the output and the log-sum-exp are kept for backward (as flash attention does):
backward recomputes each block's probabilities p = exp(s − l) and passes the key/value
gradients around the ring with the keys/values they belong to; after cp steps each rank's
accumulated dk, dv are its own.

torch's scaled_dot_product_attention returns no log-sum-exp on every backend, so the block
arithmetic is written out here (a matmul, a mask, an exp), and the ring itself has no
counterpart in DeepSpeed 0.19.8 (its sequence parallelism is Ulysses only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsnd.cp.slices import chunks_of

NEG_INF = float("-inf")


class _Ring:
    """Rotates tensors one step around a process group (to rank + 1, from rank - 1)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.size, self.rank = size, rank
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Begin sending `tensor` on and receiving its successor; (buffer, handles)."""
        incoming = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, incoming, self.prev, self.group)]  # fmt: skip
        return incoming, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(handles: list) -> None:
        for handle in handles:
            handle.wait()


def _pairs(cp: int, rank: int, src: int) -> list[tuple[int, int, bool]]:
    """(local query chunk 0/1, source key chunk 0/1, causal) for every block that is not
    masked out entirely."""
    out = []
    for qa, a in enumerate(chunks_of(cp, rank)):
        for kb, b in enumerate(chunks_of(cp, src)):
            if b <= a:
                out.append((qa, kb, b == a))
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), NEG_INF)
    return s


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv_heads, ..) → (b, heads, ..): each key/value head serves `groups` query heads
    (head h uses key/value head h // groups, as transformers' repeat_kv)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: sum over the query heads of each group."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


class RingAttention(torch.autograd.Function):
    """out (b, heads, S, d) = causal softmax attention of this rank's queries over the whole
    sequence; q (b, heads, S, d), k and v (b, kv_heads, S, d), S = two chunks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup, scale: float) -> torch.Tensor:  # fmt: skip
        ring = _Ring(group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        qf = q.float().split(half, dim=2)
        out = [torch.zeros_like(qf[0]), torch.zeros_like(qf[1])]
        lse = [torch.full((*qf[0].shape[:-1], 1), NEG_INF, device=q.device) for _ in range(2)]
        kv = torch.stack([k, v])
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_expand(t.float(), groups).split(half, dim=2) for t in kv)
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                s = _scores(qf[qa], kf[kb], scale, causal)
                block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                block_out = torch.matmul(torch.exp(s - block_lse), vf[kb])
                new_lse = torch.logaddexp(lse[qa], block_lse)
                out[qa] = (out[qa] * torch.exp(lse[qa] - new_lse)
                           + block_out * torch.exp(block_lse - new_lse))  # fmt: skip
                lse[qa] = new_lse
            if pending is not None:
                kv, handles = pending
                _Ring.finish(handles)
        result = torch.cat(out, dim=2)
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=2))
        ctx.group, ctx.scale = group, scale
        return result.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        qf = q.float().split(half, dim=2)
        do = grad_out.float()
        delta = (do * out).sum(-1, keepdim=True).split(half, dim=2)  # rowsum(dO ∘ O)
        do, lse_parts = do.split(half, dim=2), lse.split(half, dim=2)
        dq = [torch.zeros_like(qf[0]), torch.zeros_like(qf[1])]
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_expand(t.float(), groups).split(half, dim=2) for t in kv)
            dk = [torch.zeros_like(kf[0]), torch.zeros_like(kf[1])]
            dv = [torch.zeros_like(vf[0]), torch.zeros_like(vf[1])]
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                p = torch.exp(_scores(qf[qa], kf[kb], ctx.scale, causal) - lse_parts[qa])
                dv[kb] += torch.matmul(p.transpose(-1, -2), do[qa])
                ds = p * (torch.matmul(do[qa], vf[kb].transpose(-1, -2)) - delta[qa])
                dq[qa] += torch.matmul(ds, kf[kb]) * ctx.scale
                dk[kb] += torch.matmul(ds.transpose(-1, -2), qf[qa]) * ctx.scale
            dkv += torch.stack([_fold(torch.cat(dk, dim=2), groups),
                                _fold(torch.cat(dv, dim=2), groups)])  # fmt: skip
            if pending is not None:  # (received before the next message to the same peer)
                kv, handles = pending
                _Ring.finish(handles)
            # this step's key/value gradients travel on with the keys/values they belong to
            dkv, handles = ring.start(dkv)
            _Ring.finish(handles)
        return (torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None)  # fmt: skip


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention over the cp group's whole sequence; (b, S, heads, d) as transformers'
    attention functions return it."""
    return RingAttention.apply(q, k, v, group, scale).transpose(1, 2)
