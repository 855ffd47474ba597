"""Model FLOPs per token and the peak they are measured against (MFU), as pure functions.

FLOPs per trained token = 6 N + 12 L h s (PaLM, appendix B): N counts the parameters used in
matrix multiplications (every block's projections and the output head; not the input embedding,
which is a lookup, nor norms, biases or position embeddings; a head tied to the embedding counts
once), 6 = 2 (multiply-add) x 3 (forward, and backward for inputs and weights); 12 L h s is
attention's QK^T and AV over a sequence of s, h = heads x head_dim (the attention width),
computed in full as the kernels do, causal or not. N is counted on the meta device from the
family's own block (`dsnd.model.count`), so it holds for every family.
MFU = tokens/s x FLOPs per token / peak FLOP/s of the ranks that produced them, the peak being
the device's for the precision the run's matmuls use (the DeepSpeed JSON's fp16 or bf16, else
fp32): an fp16 run measured against the fp32 peak reads ~15x too high on an H100.
"""

from __future__ import annotations

import functools
import time

from dsnd.model.count import matmul_params
from dsnd.model.source import ModelSpec

DTYPES = ("fp32", "fp16", "bf16")


def _peaks(half_tflops: float, fp32_tflops: float) -> dict[str, float]:
    """fp16 and bf16 run at one tensor-core rate on every part below; fp32 is the plain (CUDA
    core, vector) rate: torch runs fp32 matmuls without TF32 unless
    `torch.backends.cuda.matmul.allow_tf32` is set, so TF32's higher tensor-core rate is not the
    peak of an fp32 run here."""
    return {"fp16": half_tflops * 1e12, "bf16": half_tflops * 1e12, "fp32": fp32_tflops * 1e12}


# Peak FLOP/s per product from the vendors' datasheets, dense (the "with sparsity" figures halved
# where a sheet gives only those). H100 SXM, H200 and GH200 are one GH100 die at the same clocks.
PEAKS: dict[str, dict[str, float]] = {
    "A100 SXM4 40GB": _peaks(312, 19.5),
    "A100 SXM4 80GB": _peaks(312, 19.5),
    "A100 PCIe 40GB": _peaks(312, 19.5),
    "A100 PCIe 80GB": _peaks(312, 19.5),
    "H100 SXM": _peaks(989.4, 67),
    "H100 PCIe": _peaks(756, 51),
    "H100 NVL": _peaks(835, 60),  # per GPU of the pair
    "H200": _peaks(989.4, 67),
    "GH200": _peaks(989.4, 67),
    "B200": _peaks(2250, 75),  # HGX B200 (1000 W); a GB200's B200 runs faster (1200 W)
    "L40S": _peaks(362.05, 91.6),
    "MI300X": _peaks(1307.4, 163.4),
}

# torch.cuda.get_device_name() -> product, matched whole: a substring match gave an H100 PCIe or
# NVL (or an H200 NVL) the SXM part's peak. A name not listed has no peak, and no MFU.
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA A100-SXM4-40GB": "A100 SXM4 40GB",
    "NVIDIA A100-SXM4-80GB": "A100 SXM4 80GB",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
    "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB",
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA GH200 144G HBM3e": "GH200",
    "NVIDIA B200": "B200",
    "NVIDIA L40S": "L40S",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI300X VF": "MI300X",  # the virtual function a cloud VM sees: the same part
}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device named as torch.cuda.get_device_name() names it, for
    matmuls in `dtype` ("fp32", "fp16" or "bf16"); None for a product not in the table."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    product = DEVICE_NAMES.get(device_name.strip())
    return None if product is None else PEAKS[product][dtype]


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


@functools.cache
def _process_cpu_peak(threads: int) -> float:
    """`measured_cpu_peak` once per process and thread count: a process that trains several runs
    (the suite's rank programs do) measures its CPU once."""
    return measured_cpu_peak()


def mfu_peak(configured: float | None, device_name: str | None, dtype: str) -> float | None:
    """Per-device peak FLOP/s for MFU: `log.peak_flops` if set; else the table's for a GPU
    (`device_name` from torch.cuda.get_device_name) in the run's `dtype`, None when the product
    is not in it (MFU is then not reported); else measured on this CPU."""
    if configured is not None:
        return float(configured)
    if device_name is not None:
        return peak_flops(device_name, dtype)
    import torch

    return _process_cpu_peak(torch.get_num_threads())
