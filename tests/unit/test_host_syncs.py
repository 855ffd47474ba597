"""No device-to-host sync per micro-batch in the losses, at most one per MoE layer (the
all-to-all's split sizes), counted on the CPU (`tests.host_syncs`) in a one-rank group; and
the math unchanged: the losses equal `F.cross_entropy`, the experts transformers' own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsnd.cp.loss import context_parallel_loss
from dsnd.moe import ExpertParallel, ParallelExperts, expert_counts
from dsnd.moe.capacity import keep_mask
from dsnd.tp import vocab_parallel_cross_entropy
from tests.host_syncs import host_syncs
from tests.models import spec_of
from tests.one_rank import one_rank_world

torch.set_num_threads(1)
GEN = torch.Generator().manual_seed(0)


@pytest.fixture
def group(tmp_path):
    with one_rank_world(str(tmp_path)) as world:
        yield world


def _flat_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_vocab_parallel_cross_entropy_syncs_nothing_and_drops_the_padding(group):
    """A slice holding padding columns (vocabulary 13 padded to 16) masks them without asking
    the device whether it has any; loss and gradient are F.cross_entropy's on the real 13."""
    logits = torch.randn(2, 5, 16, generator=GEN, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5), generator=GEN)
    labels[0, 1] = -100
    with host_syncs() as found:
        loss = vocab_parallel_cross_entropy(logits, labels, group, vocab_size=13)
        loss.backward()
    assert found == []
    ref_logits = logits.detach()[..., :13].clone().requires_grad_()
    ref = _flat_ce(ref_logits, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logits.grad[..., :13], ref_logits.grad)
    assert torch.equal(logits.grad[..., 13:], torch.zeros(2, 5, 3))


@pytest.mark.parametrize("labelled", [True, False])
def test_the_context_parallel_loss_syncs_nothing_also_on_a_slice_without_labels(group, labelled):
    """With labels the loss is the mean itself (one rank: n_r = N); without any, 0 with zero
    (not NaN) gradients, as the host-side branch it replaces returned."""
    logits = torch.randn(2, 4, 11, generator=GEN, requires_grad=True)
    labels = torch.randint(0, 11, (2, 4), generator=GEN)
    if not labelled:
        labels.fill_(-100)
    loss_fn = context_parallel_loss(_flat_ce, group)
    with host_syncs() as found:
        loss = loss_fn(logits, labels)
        loss.backward()
    assert found == []
    if labelled:
        ref_logits = logits.detach().clone().requires_grad_()
        ref = _flat_ce(ref_logits, labels)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(logits.grad, ref_logits.grad)
    else:
        assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_expert_counts_are_bincounts():
    ids = torch.randint(0, 6, (37, 2), generator=GEN)
    with host_syncs() as found:
        counts = expert_counts(ids, 8)
    assert found == []
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=8))


def test_the_capacity_mask_syncs_nothing():
    index = torch.stack([torch.randperm(8, generator=GEN)[:2] for _ in range(37)])
    with host_syncs() as found:
        keep_mask(index, 8, 1.0)
    assert found == []


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_parallel_experts_sync_once_per_layer(group, preset):
    """Forward and backward of an expert-parallel MoE layer read the device once: the split
    sizes of the all-to-all (counts by scatter, not bincount; repeat_interleave told its
    output size). The output is transformers' experts' own."""
    spec = spec_of(preset)
    torch.manual_seed(0)
    block = spec.family.block(spec.config, 1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(16, spec.hidden_size, generator=GEN)
    _, weights, index = block.mlp.gate(x)
    want = block.mlp.experts(x, index, weights)
    experts = ParallelExperts(block.mlp.experts, ExpertParallel(group, group))
    with host_syncs() as found:
        got = experts(x, index, weights)
        got.sum().backward()
    assert len(found) == 1 and found[0].startswith("tolist at experts.py"), found
    torch.testing.assert_close(got, want)
