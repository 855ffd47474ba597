"""The activation meter (`dsnd.pipeline.activations`) on plain torch modules whose saved tensors
are known: exact bytes, weights left out, storages counted once, micro-batches in flight as a
GPipe and a 1F1B order keep them, checkpointing, gradients unchanged. No processes start here."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsnd.model import LayerStack, layer_specs, lm_loss
from dsnd.pipeline.activations import ActivationMeter
from tests.models import spec_of

torch.set_num_threads(1)

B, IN, MID, OUT = 3, 8, 16, 4
F32 = 4


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, MID), nn.ReLU(), nn.Linear(MID, OUT))


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, IN, generator=torch.Generator().manual_seed(seed))


# the first Linear saves its input, ReLU its output, which the second Linear saves again (one
# storage); the second Linear saves its weight too, which is not an activation
ONE = B * IN * F32 + B * MID * F32


def _meter(model: nn.Module, every: int = 1) -> ActivationMeter:
    return ActivationMeter(lambda: [*model.parameters(), *model.buffers()], every)


def test_one_forward_counts_the_saved_activations_exactly_and_no_weights():
    model = _mlp()
    saved: list[int] = []  # every storage autograd saves, weights included

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(_x()).sum()
    # autograd does save the second Linear's weight (for its input's gradient): leaving weights
    # out is tested
    assert model[2].weight.untyped_storage().data_ptr() in saved

    meter = _meter(model)
    meter.begin()
    with meter.forward(0):
        out = model(_x()).sum()
    assert meter.live == meter.peak == ONE
    out.backward()
    meter.release(0)
    assert meter.live == 0 and meter.peak == ONE


def test_gpipe_holds_every_micro_batch_and_1f1b_one():
    model = _mlp()
    meter = _meter(model)
    m = 4
    meter.begin()  # GPipe on one stage: all forwards, then all backwards
    outs = []
    for i in range(m):
        with meter.forward(i):
            outs.append(model(_x(i)).sum())
    assert meter.peak == m * ONE
    for i, out in enumerate(outs):
        out.backward()
        meter.release(i)
        assert meter.live == (m - 1 - i) * ONE
    meter.begin()  # 1F1B on one stage: forward, backward, forward, ...
    for i in range(m):
        with meter.forward(i):
            out = model(_x(i)).sum()
        out.backward()
        meter.release(i)
    assert meter.peak == ONE and meter.live == 0


def test_steps_between_measured_ones_keep_the_last_measured_figure():
    model = _mlp()
    meter = _meter(model, every=3)
    for step in range(5):
        meter.begin()
        assert meter.measuring == (step % 3 == 0)
        with meter.forward(0):
            out = model(_x()).sum()
            if step != 3:  # a bigger micro-batch, not measured (step 4) or measured (step 0)
                out = out + model(torch.cat([_x(), _x()])).sum()
        out.backward()
        meter.release(0)
        assert meter.peak == (ONE if step >= 3 else 3 * ONE), step


def test_a_storage_saved_by_two_micro_batches_counts_once_until_both_are_done():
    scale = torch.randn(B, IN)  # not a weight: shared by both forwards (mul saves it)
    w = nn.Parameter(torch.randn(IN, IN))
    meter = ActivationMeter(lambda: [w])
    meter.begin()
    outs = []
    for i in range(2):
        with meter.forward(i):
            h = _x(i) @ w  # saves the input (for w's gradient)
            outs.append((h * scale).sum())  # saves the shared `scale` (for h's gradient)
    each = B * IN * F32  # the input
    assert meter.peak == 2 * each + B * IN * F32
    outs[0].backward()
    meter.release(0)
    assert meter.live == each + B * IN * F32  # micro-batch 1 still holds `scale`
    outs[1].backward()
    meter.release(1)
    assert meter.live == 0


def test_weights_listed_and_views_of_parameters_are_left_out():
    borrowed = torch.randn(MID, IN, requires_grad=True)  # a borrowed tied weight: a plain leaf
    x = _x().requires_grad_()
    meter = ActivationMeter(lambda: [borrowed])
    meter.begin()
    with meter.forward(0):
        out = (x @ borrowed.t()).sum()  # saves x and a view of `borrowed`
    assert meter.peak == B * IN * F32
    meter = ActivationMeter(list)  # not listed: the borrowed weight counts as an activation
    with meter.forward(0):
        out = (x @ borrowed.t()).sum()
    assert meter.peak == B * IN * F32 + MID * IN * F32
    del out


def test_checkpointing_keeps_only_the_chunk_input():
    model = _mlp()
    meter = _meter(model)
    x = _x().requires_grad_()
    with meter.forward(0):
        out = checkpoint(model, x, use_reentrant=False).sum()
    assert meter.peak == B * IN * F32
    out.backward()  # the recompute inside backward is not counted
    meter.release(0)
    assert meter.live == 0 and meter.peak == B * IN * F32


def test_a_llama_stack_gets_the_same_gradients_and_bytes_that_double_with_the_micro_batch():
    """llama-tiny's layers: gradients with the meter equal those without; the bytes of one
    micro-batch (layers and loss) grow with its size (the rotary tables do not)."""
    dims = spec_of("llama-tiny")

    def run(micro: int, meter: ActivationMeter | None) -> dict:
        model = LayerStack(layer_specs(dims), seed=0)
        ids = torch.randint(
            0, dims.vocab_size, (micro, 33), generator=torch.Generator().manual_seed(0)
        )
        block = (
            meter.forward(0)
            if meter
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with block:
            loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain = run(2, None)
    sizes = {}
    for micro in (2, 4):
        meter = ActivationMeter(list)
        meter.begin()
        grads = run(micro, meter)
        sizes[micro] = meter.peak
        if micro == 2:
            assert grads.keys() == plain.keys()
            for name, g in grads.items():
                assert torch.equal(g, plain[name]), name
    assert 1.9 < sizes[4] / sizes[2] <= 2.0, sizes
