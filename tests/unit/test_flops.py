"""FLOPs per token (dsnd/report/flops.py) against torch's own FlopCounterMode on the real model."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dsnd.config.summary import precision
from dsnd.layout_search.hardware import DEVICES, named_device
from dsnd.model import build_model, lm_loss
from dsnd.model.count import matmul_params
from dsnd.report.flops import DEVICE_NAMES, flops_per_token, mfu_peak, peak_flops
from tests.models import spec_of


@pytest.mark.parametrize(
    "dims",
    [
        spec_of("llama-tiny"),  # grouped-query attention, untied head
        spec_of("gpt2-tiny"),  # tied head (counted once), biases and positions (not counted)
        spec_of("llama-tiny", hidden_size=128, num_heads=8, num_kv_heads=8, ffn_size=352),
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


def test_mfu_peak_sources():
    assert mfu_peak(1.5e12, None, "fp32") == 1.5e12  # log.peak_flops wins
    assert mfu_peak(1.5e12, "NVIDIA H100 PCIe", "bf16") == 1.5e12
    assert mfu_peak(None, "NVIDIA H200", "bf16") == 989.4e12
    assert mfu_peak(None, "NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert mfu_peak(None, "Some Future GPU", "bf16") is None  # no peak: MFU not reported
    measured = mfu_peak(None, None, "fp32")
    assert 1e8 < measured < 1e13  # a real CPU's fp32 matmul rate, measured here


def test_an_fp16_run_is_measured_against_the_half_precision_peak():
    """fp16 runs on the tensor cores at bf16's rate; the fp32 peak made an fp16 run's MFU
    ~15x too high on an H100."""
    for name in DEVICE_NAMES:
        assert peak_flops(name, "fp16") == peak_flops(name, "bf16"), name
        assert peak_flops(name, "fp16") > 3 * peak_flops(name, "fp32"), name  # L40S: 3.95x
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp16") == 989.4e12


@pytest.mark.parametrize(
    ("name", "bf16_tflops", "fp32_tflops"),
    [
        ("NVIDIA A100-SXM4-40GB", 312, 19.5),
        ("NVIDIA A100-SXM4-80GB", 312, 19.5),
        ("NVIDIA A100-PCIE-40GB", 312, 19.5),
        ("NVIDIA A100 80GB PCIe", 312, 19.5),
        ("NVIDIA H100 80GB HBM3", 989.4, 67),
        ("NVIDIA H100 PCIe", 756, 51),
        ("NVIDIA H100 NVL", 835, 60),
        ("NVIDIA H200", 989.4, 67),
        ("NVIDIA GH200 480GB", 989.4, 67),
        ("NVIDIA B200", 2250, 75),
        ("NVIDIA L40S", 362.05, 91.6),
        ("AMD Instinct MI300X", 1307.4, 163.4),
    ],
)
def test_each_product_has_its_own_dense_peak(name, bf16_tflops, fp32_tflops):
    assert peak_flops(name, "bf16") == pytest.approx(bf16_tflops * 1e12, rel=1e-12)
    assert peak_flops(name, "fp16") == pytest.approx(bf16_tflops * 1e12, rel=1e-12)
    assert peak_flops(name, "fp32") == pytest.approx(fp32_tflops * 1e12, rel=1e-12)


def test_products_are_matched_whole_not_by_substring():
    """A substring match ("H100" in the name) gave the PCIe and NVL cards the SXM part's peak."""
    sxm = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("NVIDIA H100 PCIe", "bf16") < sxm
    assert peak_flops("NVIDIA H100 NVL", "bf16") < sxm
    assert peak_flops("NVIDIA H200 NVL", "bf16") is None  # a different card, not in the table
    assert peak_flops("H100", "bf16") is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        peak_flops("NVIDIA H200", "tf32")


def test_the_planners_devices_share_the_table_and_match_names_exactly():
    """The planner's h100 is the SXM part, the GPU bench finds it by exact product."""
    assert DEVICES["h100"].bf16_flops == peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert DEVICES["a100"].fp32_flops == peak_flops("NVIDIA A100-SXM4-80GB", "fp32")
    assert named_device("NVIDIA H100 80GB HBM3") is DEVICES["h100"]
    assert named_device("NVIDIA A100-SXM4-40GB") is DEVICES["a100-40g"]
    assert named_device("NVIDIA H100 PCIe") is None  # not the planner's SXM h100


@pytest.mark.parametrize(
    ("ds", "dtype"),
    [
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "fp32"),
        ({}, "fp32"),
    ],
)
def test_the_run_precision_comes_from_the_deepspeed_json(ds, dtype):
    assert precision(ds) == dtype
