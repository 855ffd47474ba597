"""Activation bytes per stage in real runs (2 ranks, llama-tiny, 16 samples of 64 tokens per
step in micro-batches of 2), read from metrics.jsonl's `memory_stage<s>_activation_peak_bytes`.

What the schedules must show, from one micro-batch's bytes `one`:
- one stage (dp=2, 4 micro-batches per rank): 1F1B holds one micro-batch at a time, GPipe all 4;
  the 1F1B figure equals the meter on the same layers and loss in this process (DeepSpeed's
  engine adds nothing, ZeRO-3's gathered weights are left out as ZeRO-1's are);
- two stages (8 micro-batches): 1F1B's stage s holds pp - s micro-batches, GPipe's all 8, and
  the stages' single micro-batches add up to the one-stage figure (GPT-2 too, whose last stage
  borrows the tied embedding);
- twice the tokens per sample, about twice the bytes (attention's saved tensors grow linearly
  on this CPU kernel); checkpointing every layer, a fraction of them.
"""

from __future__ import annotations

import pytest
import torch

from dsnd.model import LayerStack, layer_specs, lm_loss
from dsnd.pipeline.activations import ActivationMeter
from tests.distributed.parity import case, run_cases
from tests.models import spec_of

KEY = "memory_stage{}_activation_peak_bytes"
STEPS = ("train.steps=2",)
PP2 = ("parallel.pp=2",)
GPIPE = ("parallel.schedule=gpipe",)


def _one_micro_batch(micro: int, seq: int) -> int:
    """The meter over llama-tiny's layers and loss for one micro-batch, in this process."""
    dims = spec_of("llama-tiny")
    model = LayerStack(layer_specs(dims), seed=0)
    ids = torch.randint(0, dims.vocab_size, (micro, seq + 1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # two storages, as the data's
    meter = ActivationMeter(lambda: [*model.parameters(), *model.buffers()])
    with meter.forward(0):
        lm_loss(model(x), y)
    return meter.peak


@pytest.mark.dist
def test_schedules_hold_the_micro_batches_they_keep_in_flight(tmp_path):
    cases = [
        case("pp1", 1, sets=STEPS),
        case("pp1-gpipe", 1, sets=(*STEPS, *GPIPE)),
        case("pp1-z3", 3, sets=STEPS),
        case("pp1-seq128", 1, sets=(*STEPS, "model.seq_len=128")),
        case("pp1-ckpt1", 1, sets=(*STEPS, "parallel.activation_checkpoint_interval=1")),
        case("pp2", 1, sets=(*STEPS, *PP2)),
        case("pp2-gpipe", 1, sets=(*STEPS, *PP2, *GPIPE)),
        case("pp2-zb", 1, sets=(*STEPS, *PP2, "parallel.schedule=zb-h1")),
        case("gpt2-pp1", 1, "gpt2-tiny", sets=STEPS),
        case("gpt2-pp2-gpipe", 1, "gpt2-tiny", sets=(*STEPS, *PP2, *GPIPE)),
    ]
    got = {
        name: [[row[KEY.format(s)] for s in range(2) if KEY.format(s) in row] for row in rows]
        for name, rows in run_cases(tmp_path, 2, cases).items()
    }
    for name, rows in got.items():  # the second step repeats the first, measured, step's
        assert len(rows) == 2 and rows[0] == rows[1], (name, rows)
    peak = {name: rows[-1] for name, rows in got.items()}

    one = peak["pp1"][0]
    assert one == _one_micro_batch(2, 64)
    assert peak["pp1-z3"] == [one]
    assert peak["pp1-gpipe"] == [4 * one]
    assert 1.9 < peak["pp1-seq128"][0] / one <= 2.1, peak["pp1-seq128"]
    # checkpointing each layer keeps its input only (and the loss's tensors)
    assert 0 < peak["pp1-ckpt1"][0] < one / 4, peak["pp1-ckpt1"]

    s0, s1 = peak["pp2-gpipe"][0] / 8, peak["pp2-gpipe"][1] / 8
    assert peak["pp2"] == [2 * s0, s1]
    assert s0 + s1 == one
    # zero-bubble: a micro-batch is released at its weight pass, which comes later than 1F1B's
    # backward: at least 1F1B's figure, far below GPipe's
    for s in range(2):
        assert peak["pp2"][s] <= peak["pp2-zb"][s] < peak["pp2-gpipe"][s], peak["pp2-zb"]
    # GPT-2's head borrows the embedding from stage 0 each step: a weight, not an activation
    assert sum(peak["gpt2-pp2-gpipe"]) / 8 == peak["gpt2-pp1"][0]
