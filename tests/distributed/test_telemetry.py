"""TensorBoard output of a real 2-rank pipeline run (pp=2, ZeRO-1), read back with
tensorboard's own EventAccumulator: every scalar is there, finite and plausible; and each rank's
log file."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dsnd.pipeline.phases import PHASES
from dsnd.report.flops import flops_per_token
from dsnd.report.telemetry import MEMORY
from tests.distributed.parity import case, run_cases
from tests.models import spec_of

STEPS = 3
PEAK = 1e10  # a stated peak (log.peak_flops), so MFU can be recomputed exactly below


@pytest.mark.dist
def test_pipeline_run_writes_every_scalar_to_tensorboard(tmp_path):
    c = case("tb", 1, sets=("parallel.pp=2", f"train.steps={STEPS}", f"log.peak_flops={PEAK}"))
    rows = run_cases(tmp_path, 2, [c])["tb"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    want = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/samples_per_s",
        "perf/step_time_s",
        "perf/mfu",
        "pipeline/bubble_fraction",
        *(f"time/{p}_s" for p in PHASES),
        *(f"memory/stage{s}_{k}" for s in (0, 1) for k in MEMORY),
    }
    assert want <= tags, want - tags
    scalars = {t: [e.value for e in events.Scalars(t)] for t in want}
    for tag, values in scalars.items():
        assert len(values) == STEPS and all(math.isfinite(v) for v in values), tag
    assert scalars["train/loss"] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert 5.0 < scalars["train/loss"][0] < 5.7  # ln(256) = 5.55 for a fresh byte model
    fpt = flops_per_token(spec_of("llama-tiny"), 64)
    for tok, mfu in zip(scalars["perf/tokens_per_s"], scalars["perf/mfu"], strict=True):
        assert mfu == pytest.approx(tok * fpt / (2 * PEAK), rel=1e-5)
    for s in range(STEPS):
        step_time = scalars["perf/step_time_s"][s]
        phases = sum(scalars[f"time/{p}_s"][s] for p in PHASES)
        # disjoint phases of each rank's step (means over ranks; rank 0's clock also covers the
        # loss broadcast, the other rank's step may start a little earlier; at step 1 the last
        # stage also waits out the first stage's start-up skew)
        if s > 0:
            assert 0.3 * step_time < phases < 1.5 * step_time, (s, phases, step_time)
            assert scalars["pipeline/bubble_fraction"][s] < 1
        assert scalars["pipeline/bubble_fraction"][s] >= 0
        for stage in (0, 1):
            live = scalars[f"memory/stage{stage}_live_bytes"][s]
            # ZeRO-1, dp=1: fp32 params + grads + fp32 master + 2 Adam moments of ~half the model
            assert 1e5 < live < 4e6, live
            assert scalars[f"memory/stage{stage}_peak_bytes"][s] > live
            # 1F1B: stage 0 holds 2 micro-batches of 2 x 64 tokens, stage 1 one (with its loss)
            assert 5e5 < scalars[f"memory/stage{stage}_activation_peak_bytes"][s] < 4e6
    assert scalars["perf/samples_per_s"][0] == pytest.approx(16 / scalars["perf/step_time_s"][0])
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "preset: llama-tiny" in text and "pp: 2" in text
    # where the run started, on which layout; the held-out loss at its end (a default run's)
    (start,) = events.Tensors("events/text_summary")
    assert (start.step, start.tensor_proto.string_val[0].decode()) == (
        0,
        "started at step 0 on pp=2 dp=1 tp=1 cp=1 ep=1 (world 2)",
    )
    assert [e.step for e in events.Scalars("eval/loss")] == [STEPS]
    assert events.Scalars("eval/loss")[0].value == pytest.approx(rows[-1]["eval_loss"], rel=1e-6)
    # every rank's own log file, its lines prefixed with its coordinates
    for rank in (0, 1):
        lines = (tmp_path / "tb" / "logs" / f"rank_{rank:05d}.log").read_text().splitlines()
        records = [line for line in lines if line.startswith("[r")]  # not continuation lines
        assert records and all(r.startswith(f"[r{rank} pp{rank} dp0 tp0] ") for r in records)
        assert any(f"stage {rank} of 2 holds global layers" in line for line in lines)
