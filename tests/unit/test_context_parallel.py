"""Context parallelism's pure parts: which positions each rank holds, the balance of the ring's
causal work, the checks before start, and the bench's rows."""

from __future__ import annotations

import pytest

from dsnd.bench.context_results import context_rows
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.cp.ring import _pairs
from dsnd.cp.slices import slice_positions
from tests.config_errors import resolve_error


def test_ring_ranks_hold_an_early_and_a_late_chunk():
    assert slice_positions(8, 2, 0, "ring") == (0, 1, 6, 7)
    assert slice_positions(8, 2, 1, "ring") == (2, 3, 4, 5)
    assert slice_positions(16, 4, 1, "ring") == (2, 3, 12, 13)


def test_ulysses_ranks_hold_contiguous_slices():
    assert slice_positions(8, 2, 1, "ulysses") == (4, 5, 6, 7)
    assert slice_positions(8, 4, 2, "ulysses") == (4, 5)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_slices_cover_the_sequence_once(cp, impl):
    held = [p for rank in range(cp) for p in slice_positions(64, cp, rank, impl)]
    assert sorted(held) == list(range(64))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_gives_every_rank_the_same_causal_work(cp):
    """Per rank over the cp steps: blocks under the diagonal are full (1), on it half (1/2)."""
    work = [
        sum(0.5 if causal else 1.0 for src in range(cp) for _, _, causal in _pairs(cp, r, src))
        for r in range(cp)
    ]
    assert work == [work[0]] * cp
    assert sum(work) == (2 * cp) ** 2 / 2  # the causal half of (2cp)^2 chunk blocks


def test_bad_context_layouts_are_refused_before_start():
    assert resolve_error(["parallel.cp=4", "model.seq_len=60"], 4) == (
        "parallel.cp=4 (ring): model.seq_len=60 is not divisible by 2 * parallel.cp = 8"
    )
    assert resolve_error(["parallel.cp=2", "parallel.cp_impl=ulysses", "model.seq_len=63"], 2) == (
        "parallel.cp=2 (ulysses): model.seq_len=63 is not divisible by parallel.cp = 2"
    )
    assert "times parallel.tp = 2 (sequence parallelism)" in resolve_error(
        ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=36"], 4
    )
    assert resolve_error(["parallel.cp=4", "parallel.cp_impl=ulysses"], 4) == (
        "parallel.cp_impl=ulysses: preset llama-tiny: num_kv_heads=2 gives 2 heads per "
        "tensor-parallel rank, not divisible by parallel.cp=4 (use cp_impl: ring, which splits "
        "the sequence only)"
    )
    assert resolve_error(["parallel.cp=2", "parallel.cp_impl=stripes"], 2) == (
        "parallel.cp_impl='stripes': expected one of ring, ulysses"
    )
    assert resolve_error(["parallel.cp=3"], 4) == (
        "world size 4 is not divisible by parallel.pp * parallel.tp * parallel.cp = 1 * 1 * 3 = 3"
    )


def test_context_layout_counts_samples_by_dp_only():
    res = resolve(load(None, ["parallel.cp=2", "parallel.pp=2"]), 8)
    t = res.topology
    assert (t.pp, t.dp, t.cp, t.tp) == (2, 2, 2, 1)
    assert res.batch.train == res.batch.micro * res.batch.gas * t.dp


def _run(peak: int, step_s: float, losses=(5.0, 4.0)) -> dict:
    return {"activation_peak_bytes": peak, "step_s": step_s, "losses": list(losses)}


def test_context_rows_ratio_against_whole_sequences_with_targets():
    layouts = ["cp1", "ring-cp2", "ulysses-cp2"]
    raw = {
        "seqs": [1024],
        "layouts": layouts,
        "runs": {
            "1024/cp1": _run(1000, 1.0),
            "1024/ring-cp2": _run(560, 2.0, (5.0, 4.001)),
            "1024/ulysses-cp2": _run(500, 1.0),
        },
    }
    rows = {r.metric: r for r in context_rows(raw)}
    ring = rows["seq1024 ring-cp2 activation peak / cp1"]
    assert ring.value == pytest.approx(0.56) and ring.met is False  # above 1.1/2
    assert rows["seq1024 ulysses-cp2 activation peak / cp1"].met is True
    assert rows["seq1024 ring-cp2 losses vs cp1 (max rel diff)"].met is False  # 1e-4 exceeded
    speed = rows["seq1024 cp2 ring / ulysses throughput"]
    assert speed.value == pytest.approx(0.5) and speed.met is True


@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_written_out_equal_torchs_fused_kernel(causal):
    """The form other devices run equals the CPU kernel, forward and the block's gradients given
    a global output and log-sum-exp (here a merge of this block with a second one)."""
    import torch

    from dsnd.cp.ring import block_backward, block_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, k2, v2, do = (torch.randn(2, 3, 8, 4, generator=gen) for _ in range(6))
    got = {}
    for kernel in ("cpu", "math"):
        o1, l1, _ = block_forward(q, k, v, 0.5, causal, kernel)
        o2, l2, _ = block_forward(q, k2, v2, 0.5, False, kernel)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse)
        got[kernel] = (o1, l1, out, *block_backward(do, q, k, v, out, lse, 0.5, causal, kernel))
    for a, b in zip(got["cpu"], got["math"], strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_the_kernel_trial_passes_where_kernels_agree_and_names_what_fails():
    """`kernels_agree` is the trial a CUDA device runs before ring attention uses torch's flash
    kernel; here on the CPU kernel (grouped-query heads, fp32) it agrees, and a kernel that does
    not exist on a device is named, not raised."""
    import torch

    from dsnd.cp.ring import kernel_for, kernels_agree

    cpu = torch.device("cpu")
    assert kernels_agree("cpu", cpu, torch.float32, groups=2, head_dim=16, tokens=32) is None
    why = kernels_agree("cuda", cpu, torch.bfloat16, groups=2, head_dim=16, tokens=32)
    assert why is not None and why.startswith(("RuntimeError", "NotImplementedError"))
    assert kernel_for(torch.zeros(1, 2, 4, 8), groups=1) == "cpu"
    assert kernel_for(torch.zeros(1, 2, 4, 8, device="meta"), groups=1) == "math"
