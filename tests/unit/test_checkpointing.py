"""Activation checkpointing per layer interval: memory saved for backward, measured; gradients and
loss unchanged; DeepSpeed's chunking; the config key. No processes start here.

Memory is counted as the bytes of the non-parameter tensors autograd saves for backward during one
forward (`saved_tensors_hooks`): what a micro-batch holds from its forward until its backward.
Non-reentrant checkpointing saves only each chunk's input outside its own hooks, so at interval k
the count is exactly the chunk inputs: the token ids plus one (micro, seq, hidden) fp32 tensor per
later chunk.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError
from dsnd.model import LayerStack, layer_specs, lm_loss
from dsnd.model.checkpointing import chunk_bounds, run_layers
from tests.models import spec_of

torch.set_num_threads(1)

MICRO, SEQ = 4, 64
# Measured (torch 2.13, transformers 5.24), interval 0 -> 1 -> 2, bytes saved for backward:
#   llama-tiny 7_180_288 -> 395_264 (18.2x less) -> 198_656 (36.1x less)
#   gpt2-tiny  7_770_624 -> 395_264 (19.7x less) -> 198_656 (39.1x less)
# Pinned with a margin for other torch / transformers versions saving a little more or less.
MIN_FACTOR = {1: 15.0, 2: 30.0}


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def _saved_bytes_and_grads(preset: str, interval: int) -> tuple[int, torch.Tensor, dict]:
    """(bytes saved for backward by one forward, loss, {name: grad}) at `interval`."""
    dims = spec_of(preset)
    model = LayerStack(layer_specs(dims), seed=0, activation_checkpoint_interval=interval)
    x, y = _batch(dims.vocab_size)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in param_storages:  # weights are held anyway
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    loss = lm_loss(out, y)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return saved, loss.detach(), grads


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_checkpointing_saves_memory_with_the_same_gradients(preset):
    dims = spec_of(preset)
    base_bytes, base_loss, base_grads = _saved_bytes_and_grads(preset, 0)
    num_layers = len(layer_specs(dims))
    for interval, factor in MIN_FACTOR.items():
        saved, loss, grads = _saved_bytes_and_grads(preset, interval)
        chunks = len(chunk_bounds(num_layers, interval))
        msg = (
            f"{preset}: bytes saved for backward at interval 0: {base_bytes}, "
            f"at interval {interval}: {saved} ({base_bytes / saved:.1f}x less, pinned >= {factor}x)"
        )
        # only the chunk inputs: int64 ids, then a fp32 hidden state per later chunk
        ids_bytes = MICRO * SEQ * 8
        hidden_bytes = MICRO * SEQ * dims.hidden_size * 4
        assert saved == ids_bytes + (chunks - 1) * hidden_bytes, msg
        assert saved * factor <= base_bytes, msg
        assert abs(loss.item() - base_loss.item()) <= 1e-6, msg
        assert grads.keys() == base_grads.keys()
        for name, grad in grads.items():
            assert grad is not None, name
            torch.testing.assert_close(grad, base_grads[name], atol=1e-6, rtol=0, msg=name)


def test_chunks_follow_deepspeed_pipeline_module():
    # PipelineModule.forward: range(0, num_layers, k), the last chunk cut at num_layers
    assert chunk_bounds(7, 0) == [(0, 7)]
    assert chunk_bounds(7, 1) == [(i, i + 1) for i in range(7)]
    assert chunk_bounds(7, 2) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert chunk_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert chunk_bounds(3, 5) == [(0, 3)]
    with pytest.raises(ValueError):
        chunk_bounds(7, -1)


def test_parameter_names_do_not_change():
    specs = layer_specs(spec_of("llama-tiny"))
    off = LayerStack(specs, seed=0, layer_indices=[2, 3, 4])
    on = LayerStack(specs, seed=0, layer_indices=[2, 3, 4], activation_checkpoint_interval=2)
    assert list(on.state_dict()) == list(off.state_dict())
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        LayerStack(specs, seed=0, activation_checkpoint_interval=-1)


def test_no_recompute_in_evaluation():
    dims = spec_of("llama-tiny")
    model = LayerStack(layer_specs(dims), seed=0, activation_checkpoint_interval=1).eval()
    x, _ = _batch(dims.vocab_size)
    hooks_seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        hooks_seen.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    # eval mode runs the layers plainly: far more saved tensors than 7 chunk inputs
    assert len(hooks_seen) > 20


def test_dropout_masks_replay_in_recomputation():
    def layers() -> list[nn.Module]:
        torch.manual_seed(3)
        return [nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5)]

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    grads = []
    for interval, recompute in ((0, False), (2, True)):
        mods = layers()
        torch.manual_seed(5)
        run_layers(mods, x, interval, recompute).square().sum().backward()
        grads.append([p.grad for m in mods for p in m.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_config_key(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    res = resolve(load(None, ["parallel.activation_checkpoint_interval=2"]), 1)
    assert res.run.parallel.activation_checkpoint_interval == 2
    assert resolve(load(None), 1).run.parallel.activation_checkpoint_interval == 0
    with pytest.raises(UserError, match=r"parallel\.activation_checkpoint_interval must be >= 0"):
        resolve(load(None, ["parallel.activation_checkpoint_interval=-1"]), 1)
