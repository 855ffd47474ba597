"""Telemetry's pure half: the expert-load tags an MoE run reports."""

from __future__ import annotations

import pytest


def test_expert_load_tags_each_moe_layer_and_skips_dense_blocks():
    from dsnd.moe.numbers import expert_load

    tags, counts = expert_load([[0.0, 0.0, 0.0, 0.0], [8.0, 4.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]])
    assert counts == {"1": [8, 4, 2, 2], "2": [4, 4, 4, 4]}  # block 0 is dense
    assert tags == {
        "moe/layer1_load_max_over_mean": 2.0,
        "moe/layer1_load_min_over_mean": 0.5,
        "moe/layer2_load_max_over_mean": 1.0,
        "moe/layer2_load_min_over_mean": 1.0,
    }


def test_expert_parallel_runs_tag_the_share_of_rows_sent_off_rank():
    from dsnd.moe.numbers import expert_load

    load = [[0.0, 0.0], [6.0, 2.0], [4.0, 4.0]]
    tags, _ = expert_load(load, [0.0, 2.0, 6.0])
    assert tags["moe/layer1_sent_share"] == 0.25 and tags["moe/layer2_sent_share"] == 0.75
    assert "moe/layer0_sent_share" not in tags  # dense
    tags, _ = expert_load(load, [0.0, 0.0, 0.0])  # ep=1: nothing sent, no tag
    assert not any(t.endswith("sent_share") for t in tags)


class _FakeCuda:
    """Stands in for the torch.cuda module (no GPU on the machines the suite runs on): records
    the calls telemetry makes and answers the three memory queries with fixed byte counts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def memory_allocated(self, device) -> int:
        return 100

    def max_memory_allocated(self, device) -> int:
        return 300

    def memory_reserved(self, device) -> int:
        return 512


def test_a_cuda_step_starts_by_resetting_the_peak_and_reports_reserved_bytes():
    """`max_memory_allocated` is a peak since process start until reset: each step resets it so
    the reported peak is the step's own; reserved bytes are reported beside it."""
    import torch

    from dsnd.report.telemetry import rank_memory, start_step_memory

    cuda, gpu = _FakeCuda(), torch.device("cuda", 0)  # a device object needs no GPU
    start_step_memory(gpu, cuda)
    assert cuda.calls == [("reset_peak_memory_stats", gpu)]
    start_step_memory(torch.device("cpu"), cuda)
    assert len(cuda.calls) == 1  # nothing to reset on CPU

    assert rank_memory(gpu, lambda: 1.0, cuda) == (100.0, 300.0, 512.0)


def test_reserved_bytes_are_tagged_where_measured_and_absent_on_cpu():
    import math

    import torch

    from dsnd.report.reporter import step_row
    from dsnd.report.telemetry import STATS, step_numbers
    from dsnd.topology import Topology

    topology = Topology(pp=2, dp=1, tp=1)
    stats = torch.zeros(2, len(STATS), dtype=torch.float64)
    col = STATS.index("reserved_bytes")
    stats[0, col], stats[1, col] = 2048.0, 4096.0  # CUDA: rank r is stage r
    numbers = step_numbers(stats, topology, 1.0, 64, 4, 10.0, None)
    assert numbers["memory/stage0_reserved_bytes"] == 2048.0
    assert numbers["memory/stage1_reserved_bytes"] == 4096.0
    row = step_row(1, 2.0, 1e-3, 0.5, 1.0, 64, numbers)
    assert row["memory_stage1_reserved_bytes"] == 4096.0
    stats[:, col] = math.nan  # CPU: not measured
    numbers = step_numbers(stats, topology, 1.0, 64, 4, 10.0, None)
    assert not any(k.endswith("reserved_bytes") for k in numbers)
    assert "memory/stage0_peak_bytes" in numbers  # the other memory tags stay


def test_the_trainer_resets_the_peak_before_the_step_runs(monkeypatch):
    """The reset comes before any of the step's work, so the step's peak is all of its own."""
    from types import SimpleNamespace as NS

    import torch

    import dsnd.trainer as trainer

    events: list[str] = []

    class Stop(Exception):
        pass

    def run(batch, layout):
        events.append("run")
        raise Stop

    engine = NS(device=torch.device("cuda", 0), optimizer=NS(param_groups=[{"lr": 1e-3}]))
    monkeypatch.setattr(trainer, "start_step_memory", lambda d: events.append(f"reset {d}"))
    monkeypatch.setattr(trainer, "batch_for_step", lambda *a: [])
    monkeypatch.setattr(trainer, "batch_extras", lambda *a: None)
    res = NS(run=NS(train=NS(seed=0)), batch=NS(train=4, micro=1), topology=NS(dp=1))
    st = NS(runner=NS(engine=engine, run=run, loss_scale=lambda: 1.0), samples=None)
    with pytest.raises(Stop):
        trainer._step(res, NS(coord=NS(dp=0)), st, 0, (1.0, None), None)
    assert events == ["reset cuda:0", "run"]
