"""FLOPs per token (dsnd/flops.py) against torch's own FlopCounterMode on the real model."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dsnd.flops import flops_per_token, peak_flops
from dsnd.model import build_model, lm_loss
from dsnd.model.count import matmul_params
from tests.models import spec_of


@pytest.mark.parametrize(
    "dims",
    [
        spec_of("llama-tiny"),  # grouped-query attention, untied head
        spec_of("gpt2-tiny"),  # tied head (counted once), biases and positions (not counted)
        spec_of(
            "llama-tiny", hidden_size=128, num_heads=8, num_kv_heads=8, ffn_size=352
        ),  # fmt: skip
    ],
    ids=["llama-tiny", "gpt2-tiny", "llama-wider"],
)
def test_formula_matches_flop_counter_within_2_percent(dims):
    torch.manual_seed(0)
    model = build_model(dims, seed=1)
    batch, seq = 2, 64
    tokens = torch.randint(0, dims.vocab_size, (batch, seq))
    # the math backend runs attention as matmuls the counter sees (it has no formula for the
    # fused CPU kernel, and would count attention as 0)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(tokens), tokens).backward()
    counted = counter.get_total_flops()
    assert counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0) > 0
    formula = flops_per_token(dims, seq) * batch * seq
    assert formula == pytest.approx(counted, rel=0.02), (formula, counted)


def test_matmul_params_leave_out_lookups_norms_and_biases():
    dims = spec_of("gpt2-tiny")
    model = build_model(dims, seed=1)
    total = sum(p.numel() for p in model.parameters())
    wpe = dims.max_seq_len * dims.hidden_size
    per_block_not_matmul = 2 * 2 * dims.hidden_size + 3 * dims.hidden_size + dims.hidden_size
    per_block_not_matmul += dims.ffn_size + dims.hidden_size  # ln_1, ln_2, biases
    not_matmul = wpe + dims.num_layers * per_block_not_matmul + 2 * dims.hidden_size  # + ln_f
    assert matmul_params(dims) == total - not_matmul  # the tied wte counted once, as the head


def test_peak_flops_sources():
    assert peak_flops(1.5e12, None, bf16=False) == 1.5e12
    assert peak_flops(None, "NVIDIA H200", bf16=True) == 989e12
    assert peak_flops(None, "NVIDIA A100-SXM4-80GB", bf16=False) == 19.5e12
    with pytest.raises(ValueError, match="set log.peak_flops"):
        peak_flops(None, "Some Future GPU", bf16=True)
    measured = peak_flops(None, None, bf16=False)
    assert 1e8 < measured < 1e13  # a real CPU's fp32 matmul rate, measured here
