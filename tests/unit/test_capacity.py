"""`model.moe_capacity_factor`: which (token, choice) rows an expert keeps, and what a dropped
row does to the MoE block (nothing to its token's output, nothing to the gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from dsnd.moe.capacity import Capacity, keep_mask
from tests.config_errors import resolve_error
from tests.models import spec_of


def _loop(index: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Token by token: a row is kept while its expert has taken fewer than the capacity."""
    tokens, k = index.shape
    capacity = math.ceil(factor * tokens * k / experts)
    taken = [0] * experts
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    for t in range(tokens):
        for j in range(k):
            e = int(index[t, j])
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_keep_mask_is_earliest_tokens_first_up_to_the_capacity(factor):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(37)])
        assert torch.equal(keep_mask(index, 8, factor), _loop(index, 8, factor))
    skewed = torch.tensor([[0, 1]] * 6)  # every token picks experts 0 and 1 of 4
    assert keep_mask(skewed, 4, 1.0).sum(0).tolist() == [3, 3]  # ceil(6 * 2 / 4) each


def test_dropped_rows_add_nothing_and_are_counted():
    spec = spec_of("mixtral-tiny")
    torch.manual_seed(0)
    block = spec.family.block(spec.config, 1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    stack = torch.nn.Module()
    stack.layers = torch.nn.ModuleDict({"2": block})  # block 1 is global layer 2
    x = torch.randn(1, 16, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    router = block.mlp.gate(x.view(-1, spec.hidden_size))
    index, weights = router[2], router[1]
    keep = keep_mask(index, 4, 0.5)
    want = block.mlp.experts(x.view(-1, spec.hidden_size), index, weights * keep)
    cap = Capacity(stack, 0.5, blocks=3)
    got = block.mlp.experts(x.view(-1, spec.hidden_size), index, weights)
    assert torch.equal(got, want) and not torch.equal(
        got, block.mlp.experts.forward(x.view(-1, spec.hidden_size), index, weights)
    )
    assert cap.take().tolist() == [0.0, float((~keep).sum()), 0.0] and (~keep).sum() > 0
    assert cap.take().tolist() == [0.0, 0.0, 0.0]
    block.eval()  # an evaluation's forward: capped alike, counted in no training step
    assert torch.equal(block.mlp.experts(x.view(-1, spec.hidden_size), index, weights), want)
    assert cap.take().tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["model.moe_capacity_factor=1.0"],
            "model.moe_capacity_factor=1.0: preset llama-tiny is a dense model (llama), with no "
            "experts; set it to null",
        ),
        (
            ["model.preset=mixtral-tiny", "model.moe_capacity_factor=0"],
            "model.moe_capacity_factor=0.0 must be > 0 (null = dropless)",
        ),
        # past the experts / top-k it grows without changing anything, up to an overflow in a rank
        (
            ["model.preset=mixtral-tiny", "model.moe_capacity_factor=1e300"],
            "model.moe_capacity_factor=1e+300 must be in (0, 2] for preset mixtral-tiny (4 "
            "experts, "
            "top-2): at 2 an expert may take every token of a forward and nothing is dropped "
            "(null = "
            "dropless)",
        ),
        (
            [
                "model.preset=mixtral-tiny",
                "model.moe_capacity_factor=1.0",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            "model.moe_capacity_factor=1.0: not with parallel.sequence_parallel=true, which gives "
            "each rank a slice of every sequence (the capacity counts a rank's whole micro-batch)",
        ),
    ],
)
def test_bad_capacity_is_refused_before_start(sets, message):
    assert resolve_error(sets, 2) == message
