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

Each block runs one of three kernels (`kernel_for`), all returning and taking the log-sum-exp
the merge needs (a backward given the *global* output and log-sum-exp yields exactly the
block's share of dq, dk, dv):
- "cpu": torch's fused CPU kernel (`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`
  and its backward), in fp32. Written out instead, the ring ran at 0.13-0.62 of Ulysses' speed
  on 2 cores (docs/benchmarks.md, "Context parallelism"; `dsnd bench context`).
- "cuda": torch's flash-attention kernel (`_scaled_dot_product_flash_attention` and its
  backward) in the model's bf16/fp16, keys and values at their own head count (the kernel
  serves grouped-query attention itself, so nothing is expanded per ring step), tensor cores,
  no score matrix in memory; only the merge is fp32. Used on CUDA once a trial on the device
  (`kernels_agree`: forward and gradients of a merged pair of blocks against the written-out
  form, within bf16's tolerance) passes; otherwise the written-out form runs, with a warning
  naming why. No GPU has checked it here yet: `dsnd bench gpu` runs the same trial and times
  both.
- "math": the written-out form (fp32 score tiles), anywhere else.
public `torch` has no device-independent attention returning its log-sum-exp. The ring itself
has no counterpart in DeepSpeed 0.19.8 (its sequence parallelism is Ulysses only).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from dsnd.cp.slices import chunks_of

NEG_INF = float("-inf")
HALF = (torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)


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
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, incoming, self.prev, self.group),
        ]
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


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    kernel: str = "math",
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(softmax(q kᵀ·scale) v, its log-sum-exp (.., 1), what the kernel's backward needs back)
    of one block, output and log-sum-exp fp32, (b, h, c, d); `kernel` as `kernel_for` names
    them ("cuda" takes q, k, v in bf16/fp16, k and v at their own head count; the others fp32
    at q's)."""
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.unsqueeze(-1), ()
    if kernel == "cuda":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
        )
        return out.float(), lse.unsqueeze(-1), (cum_q, cum_k, max_q, max_k, seed, offset)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v), lse, ()


def block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    kernel: str = "math",
    aux: tuple = (),
) -> tuple[torch.Tensor, ...]:
    """One block's share of (dq, dk, dv), given the rows' global output `out` and
    log-sum-exp `lse` (so p = exp(s − lse) are the block's final probabilities) and what its
    `block_forward` returned for the kernel (`aux`); fp32."""
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale
        )
    if kernel == "cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.to(q.dtype),
            q,
            k,
            v,
            out.to(q.dtype),
            lse.squeeze(-1).contiguous(),
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return tuple(g.float() for g in grads)
    p = torch.exp(_scores(q, k, scale, causal) - lse)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return (
        torch.matmul(ds, k) * scale,
        torch.matmul(ds.transpose(-1, -2), q) * scale,
        torch.matmul(p.transpose(-1, -2), do),
    )


def kernels_agree(
    kernel: str,
    device: torch.device,
    dtype: torch.dtype,
    groups: int,
    head_dim: int = 64,
    tokens: int = 128,
) -> str | None:
    """None where `kernel` gives the written-out form's forward and block gradients (a causal
    block merged with a full one, as the ring merges them) within `dtype`'s tolerance on
    `device`, with `groups` query heads per key/value head; else why not."""
    gen = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (1, 2 * groups, tokens, head_dim), (1, 2, tokens, head_dim)
    q, do = (torch.randn(shape_q, generator=gen).to(device) for _ in range(2))
    k, v, k2, v2 = (torch.randn(shape_kv, generator=gen).to(device) for _ in range(4))
    scale, got = head_dim**-0.5, {}
    try:
        for name in (kernel, "math"):
            cast = (lambda t: t.to(dtype)) if name == "cuda" else (lambda t: t.float())
            widen = (lambda t: t) if name == "cuda" else (lambda t: _expand(t, groups))
            kb, vb, kb2, vb2 = (cast(widen(t)) for t in (k, v, k2, v2))
            o1, l1, aux = block_forward(cast(q), kb, vb, scale, True, name)
            o2, l2, _ = block_forward(cast(q), kb2, vb2, scale, False, name)
            lse = torch.logaddexp(l1, l2)
            out = o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse)
            dq, dk, dv = block_backward(cast(do), cast(q), kb, vb, out, lse, scale, True, name, aux)
            if name != "cuda":
                dk, dv = _fold(dk, groups), _fold(dv, groups)
            got[name] = (out, lse, dq, dk, dv)
    except RuntimeError as e:  # no such kernel on this device, dtype or head size
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 keeps 8 bits of mantissa
    for part, a, b in zip(
        ("output", "lse", "dq", "dk", "dv"), got[kernel], got["math"], strict=True
    ):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
        if not err <= tol:
            return f"{part} differs from the written-out form by {err:.2g} (relative)"
    return None


@functools.cache
def _cuda_flash(device: torch.device, dtype: torch.dtype, groups: int, head_dim: int) -> bool:
    why = kernels_agree("cuda", device, dtype, groups, head_dim)
    if why is not None:
        log.warning(
            "ring attention: torch's CUDA flash kernel failed its trial on %s (%s, "
            "head dim %d): %s; the written-out form runs",
            device,
            dtype,
            head_dim,
            why,
        )
    return why is None


def kernel_for(q: torch.Tensor, groups: int) -> str:
    """The kernel ring attention runs on `q`'s device: "cpu", "cuda" (bf16/fp16, head dim
    <= 256, once its trial passed on this device) or "math" (module docstring)."""
    if q.device.type == "cpu":
        return "cpu"
    head_dim = q.shape[-1]
    if (
        q.device.type == "cuda"
        and q.dtype in HALF
        and head_dim <= 256
        and head_dim % 8 == 0
        and _cuda_flash(q.device, q.dtype, groups, head_dim)
    ):
        return "cuda"
    return "math"


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv_heads, ..) → (b, heads, ..): each key/value head serves `groups` query heads
    (head h uses key/value head h // groups, as transformers' repeat_kv)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _operand(t: torch.Tensor, kernel: str) -> torch.Tensor:
    """A block kernel's input: the model's bf16/fp16 for "cuda", fp32 otherwise."""
    return t if kernel == "cuda" else t.float()


def _keys(kv: torch.Tensor, groups: int, kernel: str) -> torch.Tensor:
    """Keys or values as `kernel` takes them: at their own head count for "cuda", else fp32
    expanded to the query heads."""
    return kv if kernel == "cuda" else _expand(kv.float(), groups)


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
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        scale: float,
    ) -> torch.Tensor:
        ring = _Ring(group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        kernel = kernel_for(q, groups)
        qf = _chunks(_operand(q, kernel), half)
        out = [torch.zeros_like(qf[0], dtype=torch.float32) for _ in range(2)]
        lse = [torch.full((*qf[0].shape[:-1], 1), NEG_INF, device=q.device) for _ in range(2)]
        kv = torch.stack([k, v])
        ctx.aux = {}  # (step, query chunk, key chunk) -> the kernel's state for its backward
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_chunks(_keys(t, groups, kernel), half) for t in kv)
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                block_out, block_lse, ctx.aux[step, qa, kb] = block_forward(
                    qf[qa], kf[kb], vf[kb], scale, causal, kernel
                )
                new_lse = torch.logaddexp(lse[qa], block_lse)
                out[qa] = out[qa] * torch.exp(lse[qa] - new_lse) + block_out * torch.exp(
                    block_lse - new_lse
                )
                lse[qa] = new_lse
            if pending is not None:
                kv, handles = pending
                _Ring.finish(handles)
        # (b, S, heads, d), the layout the output projection reads: in fp32 the projection's
        # saved input and this saved output are then one tensor (+4% of a rank's activations
        # when they were two, as Ulysses still keeps: docs/benchmarks.md, "Context
        # parallelism", 0.520 against 0.500; `dsnd bench context`)
        result = torch.cat(out, dim=2).transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, result, torch.cat(lse, dim=2))
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
        return result.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        out, grad_out = out.transpose(1, 2), grad_out.transpose(1, 2)  # to (b, heads, S, d)
        ring = _Ring(ctx.group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        kernel = ctx.kernel
        qf, outs, lses = _chunks(_operand(q, kernel), half), _chunks(out, half), _chunks(lse, half)
        do = _chunks(_operand(grad_out, kernel), half)
        dq = [torch.zeros_like(qf[0], dtype=torch.float32) for _ in range(2)]
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv) if step < ring.size - 1 else None
            kf, vf = (_chunks(_keys(t, groups, kernel), half) for t in kv)
            dk = [torch.zeros_like(kf[0], dtype=torch.float32) for _ in range(2)]
            dv = [torch.zeros_like(vf[0], dtype=torch.float32) for _ in range(2)]
            for qa, kb, causal in _pairs(ring.size, ring.rank, src):
                aux = ctx.aux[step, qa, kb]
                grads = block_backward(
                    do[qa],
                    qf[qa],
                    kf[kb],
                    vf[kb],
                    outs[qa],
                    lses[qa],
                    ctx.scale,
                    causal,
                    kernel,
                    aux,
                )
                dq[qa] += grads[0]
                dk[kb] += grads[1]
                dv[kb] += grads[2]
            fold = 1 if kernel == "cuda" else groups  # the CUDA kernel sums a group's heads
            dkv += torch.stack(
                [_fold(torch.cat(dk, dim=2), fold), _fold(torch.cat(dv, dim=2), fold)]
            )
            if pending is not None:  # (received before the next message to the same peer)
                kv, handles = pending
                _Ring.finish(handles)
            # this step's key/value gradients travel on with the keys/values they belong to
            dkv, handles = ring.start(dkv)
            _Ring.finish(handles)
        return (
            torch.cat(dq, dim=2).to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
            None,
        )


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, scale: float
) -> torch.Tensor:
    """Causal attention over the cp group's whole sequence; (b, S, heads, d) as transformers'
    attention functions return it."""
    return RingAttention.apply(q, k, v, group, scale)
