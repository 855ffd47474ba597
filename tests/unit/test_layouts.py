"""`dsnd plan`'s arithmetic against published numbers: the ZeRO paper's model states,
Korthikanti et al.'s activation formulas, DeepSpeed's own estimator, Megatron's measured Selene
iteration times; and the accounting against what dsnd's blocks really save."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsnd.engine.deepspeed_api import estimate_model_states
from dsnd.layout_search import memory as mem
from dsnd.layout_search import selene
from dsnd.layout_search.hardware import DEVICES
from dsnd.layout_search.search import Problem, plan
from dsnd.layout_search.shape import from_model, gpt
from dsnd.layout_search.source import stage_split
from dsnd.layout_search.timing import in_flight, schedule_bubble
from dsnd.model.source import load_model
from dsnd.plan.schedule import StageRole, bubble, compute_order, max_in_flight, program, timeline

GB = 1e9


@pytest.mark.parametrize(("stage", "want_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_7_5b_on_64_gpus(stage, want_gb):
    # ZeRO paper, figure 1: Psi = 7.5B, Nd = 64, K = 12, mixed precision; the paper prints one
    # decimal (ZeRO-3: 16 x 7.5 / 64 = 1.875 GB, printed 1.9)
    got = sum(mem.states(stage, 7.5e9, 64, bf16=True).values()) / GB
    assert round(got, 1) == want_gb


KORTHIKANTI = [(run.name, run.hidden, run.heads) for run in selene.RUNS]
MODES = [
    (1, False, "none"),
    (8, False, "none"),
    (8, True, "none"),
    (8, False, "selective"),
    (8, True, "selective"),
    (8, False, "full"),
]


@pytest.mark.parametrize(("name", "h", "a"), KORTHIKANTI)
@pytest.mark.parametrize(("t", "sp", "recompute"), MODES)
def test_megatron_layer_accounting_reproduces_korthikanti_table_2(name, h, a, t, sp, recompute):
    shape = gpt(name, 4, h, a)
    s, b = 2048, 1
    op_by_op = mem.block_activation_bytes(shape, b, s, t, 1, sp, recompute, 2)
    closed = mem.korthikanti_bytes(s, b, h, a, t, sp, recompute)
    assert op_by_op == pytest.approx(closed, rel=0.01)


def test_korthikanti_closed_forms_at_the_175b_setting():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert mem.korthikanti_bytes(s, b, h, a, 1, False, "none") == sbh * (34 + 5 * a * s / h)
    assert mem.korthikanti_bytes(s, b, h, a, t, False, "none") == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert mem.korthikanti_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 * sbh / t)
    assert mem.korthikanti_bytes(s, b, h, a, t, False, "full") == 2 * sbh


def _saved_bytes(block: nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if not isinstance(base, nn.Parameter):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "mixtral-tiny"])
def test_block_accounting_matches_what_a_dsnd_block_saves(preset):
    model = load_model(preset, "model")
    shape = from_model(model, preset)
    b, s = 2, 128
    torch.manual_seed(0)
    block = model.family.block(model.config, 0)
    x = torch.randn(b, s, model.hidden_size, requires_grad=True)
    measured = _saved_bytes(block, x)
    predicted = mem.block_activation_bytes(shape, b, s, 1, 1, False, "none", 4)
    assert predicted == pytest.approx(measured, rel=0.02)


def test_deepspeed_estimate_is_deepspeeds_own_and_differs_by_its_fp32_gradients():
    model = load_model("llama-3.2-1b", "--model")
    shape = from_model(model, "llama-3.2-1b")
    pr = Problem(
        shape,
        stage_split(model),
        16,
        DEVICES["h100"],
        2048,
        64,
        bf16=True,
        estimate=estimate_model_states,
    )
    layouts = {
        (x.pp, x.tp, x.zero_stage): x
        for x in plan(pr)
        if x.micro_batch == 1 and not x.activation_checkpointing and x.cp == 1
    }
    z2 = layouts[(1, 1, 2)]
    psi = shape.params
    assert z2.deepspeed_estimate_bytes == estimate_model_states(2, psi, shape.largest_layer, 8, 2)
    # DeepSpeed counts 2 + 18 / N bytes per parameter: ours (2 + 14 / N) plus fp32 gradients
    ours = z2.memory_bytes["params"] + z2.memory_bytes["grads"] + z2.memory_bytes["optimizer"]
    assert z2.deepspeed_estimate_bytes == pytest.approx(ours + 4 * psi / 16, rel=1e-6)
    z3 = layouts[(1, 1, 3)]
    assert z3.deepspeed_estimate_bytes == estimate_model_states(3, psi, shape.largest_layer, 8, 2)
    assert z3.pp == 1 and z3.memory_bytes["params"] == pytest.approx(2 * psi / 16)


@pytest.mark.parametrize("run", selene.RUNS, ids=lambda r: r.name)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_selene_iteration_times_within_10_percent(run, mode):
    assert selene.predict(run, mode) == pytest.approx(selene.measured(run, mode), rel=0.10)


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("p", [2, 4])
def test_schedule_facts_past_2p_micro_batches_are_the_timeline_s(schedule, p, v):
    for m in (2 * p, 4 * p, 6 * p):
        roles = [StageRole(s, p, v) for s in range(p)]
        programs = [program(compute_order(schedule, p, s, m, v), roles[s]) for s in range(p)]
        assert schedule_bubble(schedule, p, m, v) == pytest.approx(
            bubble(timeline(programs, roles))
        )
        assert in_flight(schedule, p, m, v) == tuple(
            max_in_flight(compute_order(schedule, p, s, m, v)) for s in range(p)
        )


def test_moe_layouts_keep_experts_whole_and_count_active_flops():
    """dsnd does not split MoE blocks over tensor parallelism, so the planner offers no tp > 1
    for Mixtral; its block FLOPs count the router and a token's top-2 of 8 experts, and its
    activations a token's rows through both experts."""
    model = load_model("mixtral-8x7b", "--model")
    shape = from_model(model, "mixtral-8x7b")
    assert shape.moe and (shape.top_k, shape.experts, shape.ffn) == (2, 8, 2 * 14336)
    h = 4096
    attention = 2 * h * h + 2 * h * 1024
    assert shape.block_matmul_params == attention + 8 * h + 2 * 3 * h * 14336
    pr = Problem(shape, stage_split(model), 64, DEVICES["h100"], 4096, 128, bf16=True)
    layouts = plan(pr)
    assert layouts and {x.tp for x in layouts} == {1}
    # expert parallelism: every ep dividing dp and the 8 experts; a dense model has none
    assert {x.ep for x in layouts} == {1, 2, 4, 8}
    assert all(x.dp % x.ep == 0 for x in layouts)
    dense = load_model("llama-tiny", "--model")
    assert {
        x.ep
        for x in plan(
            Problem(
                from_model(dense, "llama-tiny"),
                stage_split(dense),
                4,
                DEVICES["a100"],
                64,
                16,
                bf16=True,
            )
        )
    } == {1}


def test_published_moe_runs():
    """Megatron-Core's Mixtral 8x7B (468 TFLOP/s per H100, TP1 EP8 PP4 VP8 on 64) and
    Megatron-Bridge's Qwen3-30B-A3B (16 H100, PP2 VP24 EP8; `dsnd.layout_search.moe_runs` cites
    both), neither fitted: measured ÷ predicted 0.92 and 0.94 (the 25.09 token-drop figure),
    inside the 0.79-1.12 the dense H100 runs span; the 25.11 dropless FP8 figure is 1.87x slower
    than predicted (the planner models neither fine-grained experts' small GEMMs nor the
    permutations around the all-to-alls: docs/planning.md). Mixtral fits 80 GB only with its
    experts split: at ep=1 each rank would hold all 8 experts' weights and gradients
    (+36.8 GiB)."""
    from dsnd.layout_search import moe_runs
    from dsnd.layout_search.search import Layout, evaluate
    from dsnd.layout_search.timing import uniform_stages

    mixtral, qwen = moe_runs.RUNS
    assert moe_runs.flops_per_token(mixtral) == pytest.approx(82.93e9, rel=1e-4)
    pr, lay = moe_runs.layout(mixtral)
    (published,) = moe_runs.published_step_s(mixtral)
    assert published / lay.step_time_s == pytest.approx(0.916, abs=0.005)
    assert lay.fits
    whole = Layout(
        lay.pp,
        1,
        lay.dp,
        1,
        1,
        lay.micro_batch,
        False,
        lay.schedule,
        lay.virtual_stages,
        lay.micro_batches,
        ep=1,
    )
    whole = evaluate(pr, whole, uniform_stages(pr.shape, lay.pp, lay.virtual_stages))
    assert not whole.fits
    extra = (
        whole.memory_bytes["params"]
        + whole.memory_bytes["grads"]
        - lay.memory_bytes["params"]
        - lay.memory_bytes["grads"]
    )
    # a stage's 8 experts of 8 layers: 8 x 8 x 3 x 4096 x 14336 parameters, 7/8 of them gone,
    # bf16 weights and gradients
    assert extra == pytest.approx(8 * 8 * 3 * 4096 * 14336 * 7 / 8 * 4, rel=1e-6)
    _, lay = moe_runs.layout(qwen)
    drop, dropless = moe_runs.published_step_s(qwen)
    assert drop / lay.step_time_s == pytest.approx(0.941, abs=0.005)
    assert dropless / lay.step_time_s == pytest.approx(1.873, abs=0.005)


def test_plan_layouts_are_valid_and_ranked():
    model = load_model("llama-tiny", "--model")
    pr = Problem(
        from_model(model, "llama-tiny"), stage_split(model), 4, DEVICES["a100"], 64, 16, bf16=True
    )
    layouts = plan(pr)
    assert layouts and all(x.fits for x in layouts)  # a tiny model fits anywhere
    for x in layouts:
        assert x.pp * x.tp * x.cp * x.dp == 4
        assert x.micro_batch * x.dp * x.micro_batches == 16
        assert x.step_time_s > 0 and set(x.memory_bytes) == {
            "params",
            "grads",
            "optimizer",
            "activations",
            "buffers",
        }
    times = [x.step_time_s for x in layouts]
    assert times == sorted(times)
    # ZeRO-3 shards every state; ZeRO-1 only the optimizer's
    by = {
        (x.pp, x.tp, x.cp, x.micro_batch, x.activation_checkpointing, x.schedule, x.zero_stage): x
        for x in layouts
    }
    z1, z3 = by[(1, 1, 1, 1, False, "1f1b", 1)], by[(1, 1, 1, 1, False, "1f1b", 3)]
    assert z3.memory_bytes["params"] == pytest.approx(z1.memory_bytes["params"] / 4)
    assert z1.memory_bytes["activations"] == z3.memory_bytes["activations"]
