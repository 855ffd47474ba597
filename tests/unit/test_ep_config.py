"""Mixture-of-experts layouts: `parallel.ep` (expert parallelism) and the routers'
load-balancing loss (`output_router_logits`): what resolves, what is refused before start, in
one line."""

from __future__ import annotations

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from tests.config_errors import resolve_error
from tests.procs import ROOT

MIXTRAL = "model.preset=mixtral-tiny"  # 4 experts per layer
QWEN3 = "model.preset=qwen3-moe-tiny"  # 8


@pytest.mark.parametrize(
    "sets, world, message",
    [
        (
            ["parallel.ep=2"],
            4,
            "parallel.ep=2: preset llama-tiny is a dense model (llama), with no experts to split; "
            "use parallel.ep=1",
        ),
        (
            ["model.preset=gpt2-tiny", "parallel.ep=2"],
            2,
            "parallel.ep=2: preset gpt2-tiny is a dense model (gpt2)",
        ),
        (
            [MIXTRAL, "parallel.ep=3"],
            3,
            "parallel.ep=3 must divide the 4 experts per layer of preset mixtral-tiny",
        ),
        ([MIXTRAL, "parallel.ep=8"], 8, "parallel.ep=8 must divide the 4 experts per layer"),
        (
            [MIXTRAL, "parallel.ep=4", "parallel.pp=2"],
            4,
            "parallel.ep=4 must divide the data-parallel size dp=2 (world / (pp * tp * cp))",
        ),
        ([QWEN3, "parallel.ep=4"], 2, "parallel.ep=4 must divide the data-parallel size dp=2"),
        ([MIXTRAL, "parallel.ep=0"], 4, "parallel.ep=0 must be >= 1"),
        ([MIXTRAL, "parallel.ep=-2"], 4, "parallel.ep=-2 must be >= 1"),
        # what DeepSpeed's ZeRO needs to keep the experts apart, and groups that would clash
        (
            [
                MIXTRAL,
                "parallel.ep=2",
                "deepspeed=ds_configs/zero2.json",
                "ds.zero_optimization.contiguous_gradients=false",
            ],
            4,
            "parallel.ep=2 at ZeRO stage 2 ({ROOT}/ds_configs/zero2.json) needs "
            "zero_optimization.contiguous_gradients=true",
        ),
        (
            [
                MIXTRAL,
                "parallel.ep=2",
                "deepspeed=ds_configs/zero1.json",
                "ds.zero_optimization.reduce_scatter=false",
            ],
            4,
            "parallel.ep=2 at ZeRO stage 1 ({ROOT}/ds_configs/zero1.json) needs "
            "zero_optimization.reduce_scatter=true",
        ),
        (
            [
                MIXTRAL,
                "parallel.ep=2",
                "deepspeed=ds_configs/zero1.json",
                "ds.zero_optimization.contiguous_gradients=false",
            ],
            4,
            "parallel.ep=2 at ZeRO stage 1 ({ROOT}/ds_configs/zero1.json) needs "
            "zero_optimization.contiguous_gradients=true",
        ),
        # Qwen3-MoE-tiny's layer 0 is dense: at pp=4 stage 0 holds no experts, so one fewer
        # parameter group than the others, and DeepSpeed's per-group norm would hang
        (
            [QWEN3, "parallel.ep=2", "parallel.pp=4", "deepspeed=ds_configs/zero1.json"],
            8,
            "parallel.partition='parameters' gives stages [0, 2, 3, 4, 7] whose optimizer "
            "parameter groups differ ([2, 3, 3, 3] per stage: decayed matrices and/or undecayed "
            "norms, biases, embeddings; with parallel.ep=2 the routed experts, which some stages "
            "lack)",
        ),
        (
            [MIXTRAL, "parallel.ep=2", "deepspeed=ds_configs/zero3.json", "parallel.dp_shard=2"],
            4,
            "parallel.ep=2 with parallel.dp_shard=2 is not supported",
        ),
        (
            [
                MIXTRAL,
                "parallel.ep=2",
                "deepspeed=ds_configs/zero3.json",
                "ds.zero_optimization.zero_hpz_partition_size=2",
            ],
            4,
            "--set ds.zero_optimization.zero_hpz_partition_size=2: zero_optimization."
            "zero_hpz_partition_size=2 with parallel.ep=2 is not supported",
        ),
    ],
)
def test_bad_ep_is_one_line_naming_the_key_and_numbers(sets, world, message):
    assert resolve_error(sets, world).startswith(message.replace("{ROOT}", ROOT))


@pytest.mark.parametrize(
    "sets, world",
    [
        ([MIXTRAL, "parallel.ep=2"], 2),
        ([MIXTRAL, "parallel.ep=4"], 4),
        ([MIXTRAL, "parallel.ep=2", "parallel.pp=2"], 4),
        ([MIXTRAL, "parallel.ep=2", "parallel.tp=2"], 4),  # attention split, experts over ep
        ([QWEN3, "parallel.ep=8"], 8),
        (["parallel.ep=1"], 1),  # a dense model at ep=1: nothing to split, nothing refused
    ],
)
def test_ep_that_resolves_keeps_the_batch_over_dp(sets, world):
    res = resolve(load(None, sets), world)
    # expert parallelism is carved out of dp: the batch still counts every data-parallel rank
    assert res.batch.train == res.batch.micro * res.batch.gas * res.topology.dp
    assert res.topology.dp % res.run.parallel.ep == 0


AUX = "model.overrides.output_router_logits=true"


def test_the_load_balancing_loss_is_refused_with_context_parallelism():
    assert resolve_error([QWEN3, AUX, "parallel.cp=2"], 2) == (
        "preset qwen3-moe-tiny: output_router_logits=true (the routers' load-balancing loss, "
        "router_aux_loss_coef=0.001) is not computed with parallel.cp=2; use parallel.cp=1 "
        "(sequence parallelism works), or set it to false "
        "(--set model.overrides.output_router_logits=false)"
    )


def test_the_load_balancing_loss_resolves_with_pp_ep_tp_sp_and_dp():
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    for sets in (["parallel.ep=2", "parallel.tp=2"], ["parallel.pp=2", "parallel.ep=2"], sp):
        res = resolve(load(None, [MIXTRAL, AUX, *sets]), 4)
        assert res.model.config.output_router_logits is True


def test_deepspeeds_autoep_section_points_at_parallel_ep():
    msg = resolve_error([MIXTRAL, 'ds.expert_parallel={"enabled": true, "autoep_size": 2}'], 2)
    assert msg.endswith(
        "'expert_parallel' is refused: DeepSpeed AutoEP is not used; dsnd splits "
        "a mixture of experts' experts itself: set parallel.ep in the run YAML "
        "(docs/models.md)"
    )
    resolve(load(None, [MIXTRAL, 'ds.expert_parallel={"enabled": false}']), 2)  # does nothing
