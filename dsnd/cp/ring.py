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

Each block runs torch's own fused attention kernel on the CPU (`torch.ops.aten.
_scaled_dot_product_flash_attention_for_cpu` and its backward, which return and take the
log-sum-exp the merge needs; the backward given the *global* output and log-sum-exp yields
exactly the block's share of dq, dk, dv). Measured on 2 cores at 8192 tokens, cp=2: the block
arithmetic written out (matmul, mask, exp on fp32 score tiles) took 8x the time of Ulysses
around the fused kernel. On other devices the written-out form runs (public `torch` has no
device-independent attention returning its log-sum-exp). The ring itself has no counterpart in
DeepSpeed 0.19.8 (its sequence parallelism is Ulysses only).
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


def _fused(q: torch.Tensor, fused: bool | None) -> bool:
    return q.device.type == "cpu" if fused is None else fused


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(softmax(q kᵀ·scale) v, its log-sum-exp (.., 1)) of one block, fp32, (b, h, c, d);
    `fused`: torch's CPU kernel (default on the CPU) or the written-out form."""
    if _fused(q, fused):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)  # fmt: skip
        return out, lse.unsqueeze(-1)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v), lse


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                   fused: bool | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One block's share of (dq, dk, dv), given the rows' global output `out` and
    log-sum-exp `lse` (so p = exp(s − lse) are the block's final probabilities)."""
    if _fused(q, fused):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale)  # fmt: skip
    p = torch.exp(_scores(q, k, scale, causal) - lse)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return (torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale,
            torch.matmul(p.transpose(-1, -2), do))  # fmt: skip


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv_heads, ..) → (b, heads, ..): each key/value head serves `groups` query heads
    (head h uses key/value head h // groups, as transformers' repeat_kv)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _chunks(t: torch.Tensor, half: int) -> list[torch.Tensor]:
    """The two sequence chunks of (b, h, 2*half, ..), each contiguous (the fused kernel's
    input)."""
    return [c.contiguous() for c in t.split(half, dim=2)]


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: sum over the query heads of each group."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


class RingAttention(torch.autograd.Function):
    """out (b, S, heads, d) = causal softmax attention of this rank's queries over the whole
    sequence; q (b, heads, S, d), k and v (b, kv_heads, S, d), S = two chunks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup, scale: float) -> torch.Tensor:  # fmt: skip
        ring = _Ring(group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        qf = _chunks(q.float(), half)
        out = [torch.zeros_like(qf[0]), torch.zeros_like(qf[1])]
        lse = [torch.full((*qf[0].shape[:-1], 1), NEG_INF, device=q.device) for _ in range(2)]
        kv = torch.stack([k, v])
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_chunks(_expand(t.float(), groups), half) for t in kv)
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                block_out, block_lse = block_forward(qf[qa], kf[kb], vf[kb], scale, causal)
                new_lse = torch.logaddexp(lse[qa], block_lse)
                out[qa] = (out[qa] * torch.exp(lse[qa] - new_lse)
                           + block_out * torch.exp(block_lse - new_lse))  # fmt: skip
                lse[qa] = new_lse
            if pending is not None:
                kv, handles = pending
                _Ring.finish(handles)
        # (b, S, heads, d), the layout the output projection reads: in fp32 the projection's
        # saved input and this saved output are then one tensor (measured: +4% of a rank's
        # activations when they were two)
        result = torch.cat(out, dim=2).transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=2))
        ctx.group, ctx.scale = group, scale
        return result.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        out, grad_out = out.transpose(1, 2), grad_out.transpose(1, 2)  # to (b, heads, S, d)
        ring = _Ring(ctx.group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        qf, outs, lses = _chunks(q.float(), half), _chunks(out, half), _chunks(lse, half)
        do = _chunks(grad_out.float(), half)
        dq = [torch.zeros_like(qf[0]), torch.zeros_like(qf[1])]
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_chunks(_expand(t.float(), groups), half) for t in kv)
            dk = [torch.zeros_like(kf[0]), torch.zeros_like(kf[1])]
            dv = [torch.zeros_like(vf[0]), torch.zeros_like(vf[1])]
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                grads = block_backward(do[qa], qf[qa], kf[kb], vf[kb], outs[qa], lses[qa],
                                       ctx.scale, causal)  # fmt: skip
                dq[qa] += grads[0]
                dk[kb] += grads[1]
                dv[kb] += grads[2]
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
    return RingAttention.apply(q, k, v, group, scale)
