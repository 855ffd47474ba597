"""Devices as the planner sees them: memory, peak FLOP/s, memory bandwidth and links, from the
vendors' datasheets (dense, no sparsity), and the efficiencies the time model runs them at.

Links are per device and per direction: ``intra`` between the devices of one node (NVLink),
``inter`` from a device to another node (its share of the node's network adapters). The time
model (`dsnd.layout_search.timing`) runs GEMMs, the attention core, memory traffic and communication
at the device's `Efficiency` of these peaks, fitted per GPU generation to published runs
(`FITTED`), and says how far those runs fell from it (`ACCURACY`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsnd.errors import UserError
from dsnd.report.flops import DEVICE_NAMES, PEAKS

GiB = 1024**3


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a device's peaks its work runs at: weight matrix multiplications and the
    attention core (QK^T, AV) of the FLOP/s peak; element-wise and optimizer traffic,
    collectives and messages of the memory and link bandwidths; and the share of the
    data-parallel communication (reduction, ZeRO-3's gathers) hidden under compute."""

    matmul: float
    attention: float
    bandwidth: float
    overlap: float = 0.0

    @classmethod
    def uniform(cls, value: float) -> Efficiency:
        """Every rate at `value`, nothing overlapped: time scales as 1 / value."""
        return cls(value, value, value)

    def of(self, kind: str) -> float:
        """The efficiency of a `dsnd.layout_search.timing.KINDS` kind."""
        return getattr(self, kind) if kind in ("matmul", "attention") else self.bandwidth


@dataclass(frozen=True)
class Accuracy:
    """How far published runs' MFU fell from the planner's prediction for them: measured ÷
    predicted ranged `low`..`high` (root mean square of the relative error `rms`) over `runs`
    runs on `device`."""

    device: str
    low: float
    high: float
    rms: float
    runs: int


GENERATIONS = {"a100": "ampere", "a100-40g": "ampere", "h100": "hopper", "h200": "hopper"}
"""The fitted efficiencies each datasheet device runs at: its GPU generation's (an H200 is an
H100's die with more and faster memory; a device given by its figures runs at Hopper's)."""

FITTED = {
    "ampere": Efficiency(matmul=0.756, attention=0.513, bandwidth=0.710, overlap=0.371),
    "hopper": Efficiency(matmul=0.607, attention=0.295, bandwidth=0.710, overlap=0.371),
}
"""Least squares on the log of step time over the published runs of `dsnd.layout_search.dense_runs`
(`dsnd.layout_search.calibration.fit`): GEMM and attention efficiencies per generation, bandwidth
and overlap shared (they are the links' and the frameworks', not the tensor cores')."""

ACCURACY = {
    "ampere": Accuracy("a100", low=0.70, high=1.15, rms=0.114, runs=72),
    "hopper": Accuracy("h100", low=0.79, high=1.12, rms=0.091, runs=72),
}
"""Measured ÷ predicted MFU over each generation's fitted runs at `FITTED`, the range rounded
outwards to 0.01 (`dsnd.layout_search.calibration.accuracy`; a unit test recomputes both)."""


@dataclass(frozen=True)
class Device:
    """One accelerator and its links."""

    name: str
    memory_bytes: float
    bf16_flops: float
    fp32_flops: float
    hbm_bytes_per_s: float
    intra_bytes_per_s: float  # per direction, to a device of the same node
    inter_bytes_per_s: float  # per direction, to another node
    per_node: int = 8
    efficiency: Efficiency = FITTED["hopper"]
    product: str | None = None  # the `dsnd.report.flops.PEAKS` product, for a datasheet device
    accuracy: Accuracy | None = ACCURACY["hopper"]  # None: no published runs (a CPU)

    def flops(self, bf16: bool) -> float:
        return self.bf16_flops if bf16 else self.fp32_flops


def _gpu(
    name: str, product: str, mem_gib: float, hbm_tb: float, intra_gb: float, inter_gb: float
) -> Device:
    peaks = PEAKS[product]  # the same figures MFU is measured against
    gen = GENERATIONS[name]
    return Device(
        name,
        mem_gib * GiB,
        peaks["bf16"],
        peaks["fp32"],
        hbm_tb * 1e12,
        intra_gb * 1e9,
        inter_gb * 1e9,
        product=product,
        efficiency=FITTED[gen],
        accuracy=ACCURACY[gen],
    )


DEVICES: dict[str, Device] = {
    # A100 SXM: 12 NVLink 3 links x 25 GB/s per direction; one 200 Gb/s HDR adapter per GPU.
    "a100": _gpu("a100", "A100 SXM4 80GB", 80, 2.039, 300, 25),
    "a100-40g": _gpu("a100-40g", "A100 SXM4 40GB", 40, 1.555, 300, 25),
    # H100/H200 SXM: 18 NVLink 4 links x 25 GB/s per direction; one 400 Gb/s NDR adapter per GPU.
    "h100": _gpu("h100", "H100 SXM", 80, 3.35, 450, 50),
    "h200": _gpu("h200", "H200", 141, 4.8, 450, 50),
}


def named_device(device_name: str) -> Device | None:
    """The planner's device for a GPU as torch.cuda.get_device_name() names it, matched by exact
    product (an H100 PCIe is not the planner's SXM h100); None for a product it has no entry
    for."""
    product = DEVICE_NAMES.get(device_name.strip())
    return next((d for d in DEVICES.values() if product and d.product == product), None)


def device(
    name: str | None,
    *,
    memory_gib: float | None = None,
    tflops: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    per_node: int | None = None,
) -> Device:
    """A named device with any of its figures overridden, or (no name) one described wholly
    by the figures; unknown names and missing figures are refused in one line."""
    if name is not None:
        try:
            base = DEVICES[name.lower()]
        except KeyError:
            known = ", ".join(DEVICES)
            raise UserError(
                f"--gpu {name!r} is not a known device; known: {known} (or give "
                "--gpu-mem, --gpu-flops, --intra-bw, --inter-bw)"
            ) from None
    else:
        missing = [
            flag
            for flag, v in (
                ("--gpu-mem", memory_gib),
                ("--gpu-flops", tflops),
                ("--intra-bw", intra_gbps),
                ("--inter-bw", inter_gbps),
            )
            if v is None
        ]
        if missing:
            raise UserError(
                f"without --gpu, plan needs {', '.join(missing)} (or name a device: "
                f"--gpu {'|'.join(DEVICES)})"
            )
        # No datasheet: memory bandwidth scaled with compute as on an H100 (FLOP per byte).
        ratio = DEVICES["h100"].hbm_bytes_per_s / DEVICES["h100"].bf16_flops
        base = Device("custom", 0, 0, 0, 0, 0, 0)
        base = replace(base, hbm_bytes_per_s=ratio * float(tflops) * 1e12)  # type: ignore[arg-type]
    changes: dict[str, float | int] = {}
    figures = (
        ("memory_bytes", memory_gib, GiB),
        ("intra_bytes_per_s", intra_gbps, 1e9),
        ("inter_bytes_per_s", inter_gbps, 1e9),
    )
    for key, value, scale in figures:
        if value is not None:
            if value <= 0:
                raise UserError(f"device figure {key} must be > 0, got {value}")
            changes[key] = value * scale
    if tflops is not None:
        if tflops <= 0:
            raise UserError(f"--gpu-flops must be > 0 TFLOP/s, got {tflops}")
        changes["bf16_flops"] = changes["fp32_flops"] = tflops * 1e12
    if per_node is not None:
        if per_node < 1:
            raise UserError(f"--gpus-per-node must be >= 1, got {per_node}")
        changes["per_node"] = per_node
    return replace(base, **changes)  # type: ignore[arg-type]


def this_cpu(world: int) -> Device:
    """This machine as `world` one-thread ranks (what tests and ``--validate`` run): each rank's
    share of the cores at the single-thread fp32 matmul peak and copy bandwidth measured here;
    the same copy bandwidth for gloo's loopback links (an upper bound: they copy through
    sockets); all of the RAM. Efficiency 1 until `dsnd.layout_search.validate` calibrates it."""
    import os
    import time

    import torch

    from dsnd.report.flops import measured_cpu_peak

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = measured_cpu_peak()
        src = torch.ones(16 * 1024 * 1024)  # 64 MiB
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    copy = 2 * src.numel() * 4 / best  # read and write
    share = min(1.0, (os.cpu_count() or 1) / max(world, 1))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(
        "cpu",
        float(ram),
        peak * share,
        peak * share,
        copy * share,
        copy * share,
        copy * share,
        per_node=max(world, 1),
        efficiency=Efficiency.uniform(1.0),
        accuracy=None,
    )
