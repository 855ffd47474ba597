"""Per-step numbers beyond the loss: throughput, MFU, step time by phase, pipeline bubble and
memory per stage. Every rank measures itself; one all-gather brings the numbers to every rank
and `step_numbers` (pure) turns them into TensorBoard tags.

Memory per rank: on CUDA, allocated bytes as "live", the step's peak allocated bytes as "peak"
(the allocator's peak statistics are reset as each step starts, `start_step_memory`: otherwise
`max_memory_allocated` is the peak since the process started, and every step would report the
worst one so far) and the bytes the caching allocator holds from the driver as "reserved"
(allocated + cached free blocks: what another process on the GPU cannot have, and what an
out-of-memory error is measured against); on CPU, the bytes of the model states the rank holds
(parameters, gradients, fp32 masters, optimizer state; `dsnd.engine.memory`) as "live", the
process's peak resident set as "peak" (all of Python and torch since the start, an upper
bound) and no "reserved" (NaN in the gathered stats, no tag). On every device,
"activation_peak": the most bytes of activations the rank held for backward at once in a step
(`dsnd.pipeline.activations`, measured on sampled steps), which the micro-batches in flight, the
sequence length and context parallelism set.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsnd.pipeline.phases import PHASES
from dsnd.topology import Topology

STATS = (
    *PHASES,
    "live_bytes",
    "peak_bytes",
    "reserved_bytes",
    "activation_peak_bytes",
    "stop_requested",
    "step_skipped",
)
MEMORY = ("live_bytes", "peak_bytes", "activation_peak_bytes")  # tagged on every device
CUDA_MEMORY = ("reserved_bytes",)  # tagged where measured (CUDA), absent on CPU


def start_step_memory(device: torch.device, cuda: Any = torch.cuda) -> None:
    """Called as a step starts: on CUDA, reset the allocator's peak statistics so that the peak
    `rank_memory` reads at the step's end is this step's own. Nothing on CPU (a process's peak
    RSS cannot be reset). `cuda` is the torch.cuda module, passed in so tests can watch it."""
    if device.type == "cuda":
        cuda.reset_peak_memory_stats(device)


def rank_memory(
    device: torch.device, model_states: Callable[[], float], cuda: Any = torch.cuda
) -> tuple[float, float, float]:
    """(live, peak, reserved) bytes of this rank on `device` (see the module docstring);
    reserved is NaN on CPU, where no caching allocator holds memory, and live is the stage's
    model states there (`model_states`: the engine adapter counts them)."""
    if device.type == "cuda":
        return (
            float(cuda.memory_allocated(device)),
            float(cuda.max_memory_allocated(device)),
            float(cuda.memory_reserved(device)),
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return float(model_states()), float(peak_kib * 1024), math.nan


def gather_stats(
    times: dict[str, float],
    memory: tuple[float, float, float],
    skipped: bool,
    device: torch.device,
    stop_requested: bool = False,
    activation_bytes: int = 0,
) -> torch.Tensor:
    """(world, len(STATS)) float64: every rank's phase times, memory (`memory` from
    `rank_memory`; `activation_bytes`: the step's `StepResult.activation_peak_bytes`), stop
    request and whether DeepSpeed `skipped` its optimizer step (collective, on `device`). The
    stop request rides along so that all ranks agree on the step to stop at without a collective
    of its own; the skip so that `check_skips_agree` can see every rank's."""
    mine = torch.tensor(
        [times[p] for p in PHASES]
        + list(memory)
        + [float(activation_bytes), float(stop_requested), float(skipped)],
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).cpu()


def stop_agreed(stats: torch.Tensor) -> bool:
    """True when any rank asked to stop at this step (the same answer on every rank)."""
    return bool(stats[:, STATS.index("stop_requested")].max() > 0)


def check_skips_agree(stats: torch.Tensor) -> None:
    """RuntimeError unless every rank applied the step or every rank skipped it. fp16's
    overflow skips must be taken by all stages together (DeepSpeed decides over its
    model-parallel group, which dsnd's mpu makes the whole replica, and the data group); one
    stage stepping while another skips would silently train a different model."""
    skipped = stats[:, STATS.index("step_skipped")] > 0
    if skipped.any() and not skipped.all():
        ranks = [i for i, s in enumerate(skipped.tolist()) if s]
        raise RuntimeError(
            f"ranks {ranks} skipped the optimizer step (gradient overflow) and "
            f"the other ranks of {len(skipped)} applied it"
        )


def step_numbers(
    stats: torch.Tensor,
    topology: Topology,
    elapsed: float,
    tokens: int,
    samples: int,
    flops_per_token: float,
    peak_flops: float | None,
) -> dict[str, float | None]:
    """TensorBoard tags for one step. Times are means over ranks; the bubble is the mean share of
    the step a rank spends blocked in pipeline receives; MFU = achieved model FLOP/s over the
    peak of all ranks; memory is the largest rank of each pipeline stage (reserved bytes only
    where measured: CUDA)."""
    col = {name: i for i, name in enumerate(STATS)}
    # plain floats from here: indexing the tensor per tag cost more than the numbers (every
    # step, on every rank)
    mean = stats.mean(dim=0).tolist()
    rows = stats.tolist()
    tokens_per_s = tokens / elapsed
    world = len(rows)
    out: dict[str, float | None] = {
        "perf/tokens_per_s": tokens_per_s,
        "perf/samples_per_s": samples / elapsed,
        "perf/step_time_s": elapsed,
        "perf/mfu": tokens_per_s * flops_per_token / (world * peak_flops) if peak_flops else None,
        "pipeline/bubble_fraction": mean[col["pipeline_wait"]] / elapsed,
    }
    for phase in PHASES:
        out[f"time/{phase}_s"] = mean[col[phase]]
    stage_of = [topology.coord(r).pp for r in range(world)]
    for stage in range(topology.pp):
        ranks = [row for row, s in zip(rows, stage_of, strict=True) if s == stage]
        for kind in MEMORY:
            out[f"memory/stage{stage}_{kind}"] = max(row[col[kind]] for row in ranks)
        for kind in CUDA_MEMORY:
            measured = [row[col[kind]] for row in ranks if not math.isnan(row[col[kind]])]
            if measured:
                out[f"memory/stage{stage}_{kind}"] = max(measured)
    return out
