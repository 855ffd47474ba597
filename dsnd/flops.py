"""Model FLOPs per token and the peak they are measured against (MFU), as pure functions.

FLOPs per trained token = 6 N + 12 L h s (PaLM, appendix B): N counts the parameters used in
matrix multiplications (every block's projections and the output head; not the input embedding,
which is a lookup, nor norms, biases or position embeddings; a head tied to the embedding counts
once), 6 = 2 (multiply-add) x 3 (forward, and backward for inputs and weights); 12 L h s is
attention's QK^T and AV over a sequence of s, h = heads x head_dim (the attention width),
computed in full as the kernels do, causal or not. N is counted on the meta device from the
family's own block (`dsnd.model.count`), so it holds for every family.
MFU = tokens/s x FLOPs per token / peak FLOP/s of the ranks that produced them.
"""

from __future__ import annotations

import time

from dsnd.model.count import matmul_params
from dsnd.model.source import ModelSpec

# Dense peak FLOP/s per device (no sparsity), by name as torch.cuda.get_device_name reports it.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
}


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    attention = 12.0 * model.num_layers * model.num_heads * model.head_dim * seq_len
    return 6.0 * matmul_params(model) + attention


def measured_cpu_peak(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` fp32 (size x size) matmuls with this process's threads:
    the CPU's practical peak for MFU (no vendor figure exists for an arbitrary CPU)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(configured: float | None, device_name: str | None, bf16: bool) -> float:
    """Per-device peak FLOP/s for MFU: `log.peak_flops` if set; else the table entry of a known
    GPU (`device_name` from torch.cuda.get_device_name); else measured on this CPU."""
    if configured is not None:
        return float(configured)
    if device_name is not None:
        for name, peaks in GPU_PEAKS.items():
            if name in device_name:
                return peaks["bf16" if bf16 else "fp32"]
        raise ValueError(f"no peak FLOP/s known for {device_name!r}: set log.peak_flops")
    return measured_cpu_peak()
