"""The attention kernels dsnd picks on a device, against the written-out (math) path: equal within
the dtype's tolerance, and how much faster. Part of ``dsnd bench gpu``; on the CPU the same rows
compare the CPU kernels (what the unit tests run).

- Ring attention's block kernel (`dsnd.cp.ring.kernel_for`: torch's flash kernel on CUDA, its
  fused kernel on the CPU), forward and backward of one causal block with its log-sum-exp, keys
  and values at a quarter of the query heads (grouped-query attention), against the written-out
  block in fp32.
- Document packing (`dsnd.model.documents`): attention under the block-diagonal causal mask
  through SDPA's default choice of kernel (memory-efficient on CUDA takes the mask) against
  SDPA's math backend, forward and backward.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsnd.bench.rows import Row, Target, median
from dsnd.cp import ring

BENCH = "gpu"
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
RING_TOKENS, PACKED_TOKENS, DOCUMENTS = 4096, 2048, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(run, device: torch.device, repeats: int) -> float:
    """Median seconds of `run()` over `repeats`, after one warm-up; synchronised around each."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def ring_kernel_rows(
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    tokens: int = RING_TOKENS,
    head_dim: int = HEAD_DIM,
) -> list[Row]:
    """Ring attention's block kernel on `device` against the written-out block."""
    groups = HEADS // KV_HEADS
    probe = torch.zeros(1, HEADS, 1, head_dim, device=device, dtype=dtype)
    kernel = "cuda" if device.type == "cuda" else ring.kernel_for(probe, groups)
    why = ring.kernels_agree(kernel, device, dtype, groups, head_dim, tokens=min(tokens, 256))
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, HEADS, tokens, head_dim, generator=gen).to(device) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, tokens, head_dim, generator=gen).to(device) for _ in range(2))
    scale = head_dim**-0.5

    def block(name: str):
        cast = (lambda t: t.to(dtype)) if name == "cuda" else (lambda t: t.float())
        kv = [cast(t if name == "cuda" else ring._expand(t, groups)) for t in (k, v)]
        qc, doc = cast(q), cast(do)

        def run() -> None:
            out, lse, aux = ring.block_forward(qc, *kv, scale, True, name)
            ring.block_backward(doc, qc, *kv, out, lse, scale, True, name, aux)

        return run

    shape = f"{HEADS} heads ({KV_HEADS} key/value), head dim {head_dim}, {tokens} tokens"
    rows = [
        Row(
            "ring_kernel_agrees",
            0.0 if why else 1.0,
            Target.at_least(1.0),
            why
            or f"{kernel} kernel = written-out block within {dtype} tolerance, "
            "forward and gradients of a merged causal + full pair",
            BENCH,
        )
    ]
    if why is None and kernel != "math":
        fast, slow = (_seconds(block(n), device, repeats) for n in (kernel, "math"))
        rows.append(
            Row(
                "ring_kernel_speedup",
                slow / fast,
                Target.at_least(1.0),
                f"written-out fp32 block / {kernel} kernel, one causal block forward + "
                f"backward, {shape}: {1e3 * fast:.2f} vs {1e3 * slow:.2f} ms",
                BENCH,
            )
        )
    return rows


def packing_rows(
    device: torch.device, dtype: torch.dtype, repeats: int, tokens: int = PACKED_TOKENS
) -> list[Row]:
    """Attention under a packed micro-batch's document mask: SDPA's kernel against its math
    backend."""
    gen = torch.Generator().manual_seed(0)
    ids = (torch.arange(tokens, device=device) * DOCUMENTS // tokens).view(1, tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    mask = ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)
    q, k, v, do = (
        torch.randn(1, HEADS, tokens, HEAD_DIM, generator=gen).to(device, dtype) for _ in range(4)
    )

    def run(backends) -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        out.backward(do)
        return (out.detach(), *(t.grad for t in leaves))

    every = [
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ]
    fused, math = run(every), run([SDPBackend.MATH])
    err = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(fused, math, strict=True)
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    fast = _seconds(lambda: run(every), device, repeats)
    slow = _seconds(lambda: run([SDPBackend.MATH]), device, repeats)
    what = f"{DOCUMENTS} documents in {tokens} tokens, {HEADS} heads, head dim {HEAD_DIM}, {dtype}"
    return [
        Row(
            "packing_kernel_error",
            err,
            Target.at_most(tol),
            f"SDPA's kernel vs its math backend under the document mask, output and gradients "
            f"(max relative), {what}",
            BENCH,
        ),
        Row(
            "packing_kernel_speedup",
            slow / fast,
            Target.at_least(1.0),
            f"math backend / SDPA's choice, forward + backward: {1e3 * fast:.2f} vs "
            f"{1e3 * slow:.2f} ms",
            BENCH,
        ),
    ]
