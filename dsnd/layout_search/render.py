"""How `dsnd plan` prints a device, its prediction's accuracy and the ranked layouts: the MFU with
the range published runs give it, the memory per device in words."""

from __future__ import annotations

from dsnd.layout_search.hardware import Device
from dsnd.layout_search.search import Layout

GIB = 1024**3
WORDS = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optim",
    "activations": "acts",
    "buffers": "buffers",
}
"""`Layout.memory_bytes` keys as the table names them."""


def device_lines(d: Device, bf16: bool) -> list[str]:
    """The device's figures (`h100 (80 GiB, ...)`), the efficiencies the time model runs it at,
    and how far published runs fell from the model."""
    e = d.efficiency
    lines = [
        f"{d.name} ({d.memory_bytes / GIB:.0f} GiB, {d.flops(bf16) / 1e12:.4g} "
        f"TFLOP/s, HBM {d.hbm_bytes_per_s / 1e9:.0f} GB/s, links {d.intra_bytes_per_s / 1e9:.0f}"
        f" / {d.inter_bytes_per_s / 1e9:.0f} GB/s, {d.per_node} per node)",
        f"efficiency: GEMMs {e.matmul:.3g}, attention {e.attention:.3g}, memory and links "
        f"{e.bandwidth:.3g} of peak; {e.overlap:.0%} of data-parallel traffic hidden under "
        "compute"
        + (
            " (not fitted: --validate calibrates it here)"
            if d.accuracy is None
            else " (fitted to published runs)"
        ),
    ]
    a = d.accuracy
    if a is None:
        lines.append("accuracy: no published runs for this device (--validate measures here)")
    else:
        on = "" if d.product else f" (this device is given by its figures: {a.device}'s fit)"
        lines.append(
            f"accuracy: on {a.runs} published {a.device} runs the measured MFU was "
            f"{a.low:.2f}-{a.high:.2f}x the prediction (rms {a.rms:.1%}); the MFU "
            f"column's range applies that{on}"
        )
    return lines


def mfu_text(lay: Layout) -> str:
    """ "40.1% (31.7-44.9)": the predicted MFU and the range published runs give it."""
    if lay.mfu_range is None:
        return f"{lay.mfu:.1%}"
    low, high = lay.mfu_range
    return f"{lay.mfu:.1%} ({low:.1%}-{high:.1%})".replace("%-", "-")


def _gib(v: float) -> str:
    g = v / GIB
    return f"{g:.1f}" if g >= 0.1 or g == 0 else f"{g:.2g}"


def memory_words(lay: Layout) -> str:
    """ "params 3.8 + grads 3.8 + optim 1.4 + acts 31.8 + buffers 0.031 = 40.9 GiB"."""
    parts = " + ".join(f"{WORDS.get(k, k)} {_gib(v)}" for k, v in lay.memory_bytes.items())
    return f"{parts} = {_gib(lay.total_bytes)} GiB"


def table(layouts: list[Layout]) -> list[str]:
    """The ranked layouts: step time, MFU and its range, memory per device, whether it fits."""
    width = max([44, *(len(lay.key()) for lay in layouts)])
    mfu = max([len("MFU (range)"), *(len(mfu_text(lay)) for lay in layouts)])
    lines = [
        f"{'#':>3}  {'layout':<{width}} {'s/step':>8}  {'MFU (range)':<{mfu}}  fits  "
        "memory per device (GiB)"
    ]
    for i, lay in enumerate(layouts, 1):
        lines.append(
            f"{i:>3}  {lay.key():<{width}} {lay.step_time_s:>8.4g}  "
            f"{mfu_text(lay):<{mfu}}  {'yes' if lay.fits else 'NO ':<4}  "
            f"{memory_words(lay)}"
        )
    return lines
