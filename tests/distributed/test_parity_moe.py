"""Mixture-of-experts models train the same on 4-rank layouts as in one plain PyTorch process:
Mixtral-tiny (4 experts, top-2) and Qwen3-MoE-tiny (8 experts, top-2 renormalised, layer 0
dense), experts whole on each rank (ep=1) or split over expert-parallel groups of 2 or 4 ranks
(tokens exchanged by all-to-all), with attention over 2 tensor-parallel ranks (with and without
sequence parallelism) or 2 context-parallel ranks, over pipeline stages (1F1B, zero-bubble H1
whose weight pass runs the router's and experts' gradients apart, interleaved with activation
checkpointing) and data parallelism, ZeRO-0 to ZeRO-3 (with ep > 1 a rank holds only its
experts, sharded and averaged over the ranks holding the same ones; also with parameters and
optimizer offloaded to the CPU). Losses, gradient norms and
learning rates within 1e-4 relative over five steps.

In the same launch, checkpoints: Qwen3-MoE at pp=2 x dp=2 x ep=2 ZeRO-3 resumes exactly (5 + 5
steps equal 10 straight, float equality), and its step-5 checkpoint continues at pp=1 x dp=4 x
ep=4 (ZeRO-1) and at tp=2 x dp=2, ep=1 (ZeRO-2) within 1e-4 of the straight run; every layout's
metrics count the tokens each expert received, and with ep > 1 the rows each layer's
all-to-all sent to another rank. Both families with the routers' load-balancing loss
(`output_router_logits`, which pools every layer's routing: its running sums travel with the
activations through 2 and 4 pipeline stages, also under ZB-H1 and interleaved with activation
checkpointing) at ZeRO-0, 2 and 3, with ep and with tp under sequence parallelism (the tp
ranks' sums added up): the same losses, of which the load-balancing part is also compared.
Both families with a capacity factor of 1.0: the same rows dropped, layer by layer, as one
process. Mixtral in bf16 at ZeRO-2 with ep=2: within 1% of the fp32 reference.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.parity import RTOL, assert_same, case, run_cases

OFFLOAD = (
    'ds.zero_optimization.offload_optimizer={"device": "cpu"}',
    'ds.zero_optimization.offload_param={"device": "cpu"}',
    "ds.optimizer.params.torch_adam=null",
)  # DeepSpeedCPUAdam on the offloaded states
AUX = ("model.overrides.output_router_logits=true", "model.overrides.router_aux_loss_coef=0.2")
FAMILIES = {
    "mixtral": ("mixtral-tiny", ()),
    "qwen3moe": ("qwen3-moe-tiny", ()),
    "mixtralaux": ("mixtral-tiny", AUX),
    "qwen3moeaux": ("qwen3-moe-tiny", AUX),
    "mixtralcap": ("mixtral-tiny", ("model.moe_capacity_factor=1.0",)),
    "qwen3moecap": ("qwen3-moe-tiny", ("model.moe_capacity_factor=1.0",)),
}
"""Case name prefixes: the preset and its sets (with the routers' load-balancing loss, its
coefficient ten times Mixtral's and 200 times Qwen3-MoE's, so that its share shows at
1e-4)."""
EP2, TP2 = "parallel.ep=2", "parallel.tp=2"


def moe_case(name: str, zero: int | None, *sets: str, reference: bool = False) -> dict:
    preset, family_sets = FAMILIES[name.split("-")[0]]
    return case(name, zero, preset, reference, (*family_sets, *sets))


@pytest.mark.dist
def test_moe_families_on_pipeline_and_data_parallel_layouts(tmp_path):
    (tmp_path / "w1").mkdir()
    (tmp_path / "w4").mkdir()
    refs = run_cases(
        tmp_path / "w1", 1, [moe_case(f"{f}-ref", None, reference=True) for f in FAMILIES]
    )
    got = run_cases(
        tmp_path / "w4",
        4,
        [
            moe_case("mixtral-pp2-dp2-zbh1-z1", 1, "parallel.pp=2", "parallel.schedule=zb-h1"),
            moe_case("mixtral-dp4-ep2-z3-offload", 3, EP2, *OFFLOAD),
            moe_case("mixtral-pp2-dp2-ep2-z1", 1, "parallel.pp=2", EP2),
            moe_case("mixtral-dp4-ep4-z0", 0, "parallel.ep=4"),
            moe_case("mixtral-tp2-dp2-ep2-z1", 1, TP2, EP2),  # MoE block whole on both tp ranks
            moe_case("mixtral-cp2-dp2-ep2-z1", 1, "parallel.cp=2", EP2),  # ring attention
            moe_case("qwen3moe-pp2-dp2-z3", 3, "parallel.pp=2"),
            moe_case("qwen3moe-dp4-ep2-z3", 3, EP2),  # expert-data-parallel groups of 2
            moe_case("qwen3moe-tp2-dp2-ep2-sp-z2", 2, TP2, EP2, "parallel.sequence_parallel=true"),
            moe_case("qwen3moe-pp2-dp2-ep2-z1", 1, "parallel.pp=2", EP2),
            moe_case("qwen3moe-tp2-dp2-ep2-z1", 1, TP2, EP2),
            # bf16 (fp32 masters), experts sharded over their own ranks: close to fp32, not equal
            moe_case("mixtral-dp4-ep2-z2-bf16", 2, EP2, "ds.bf16.enabled=true"),
            # with the load-balancing loss, its sums carried from stage to stage
            moe_case("mixtralaux-pp4-z0", 0, "parallel.pp=4"),  # across three stage boundaries
            moe_case(
                "mixtralaux-pp2-dp2-ep2-zbh1-z2", 2, "parallel.pp=2", EP2, "parallel.schedule=zb-h1"
            ),
            moe_case(
                "mixtralaux-tp2-dp2-ep2-sp-z2", 2, TP2, EP2, "parallel.sequence_parallel=true"
            ),
            moe_case(
                "qwen3moeaux-pp2-dp2-ep2-il2-ac-z3",
                3,
                "parallel.pp=2",
                EP2,
                "parallel.schedule=interleaved-1f1b",
                "parallel.virtual_stages=2",
                "parallel.activation_checkpoint_interval=1",
            ),
            # capacity 1.0: each expert takes at most 1/E of a rank's rows of a forward
            moe_case("mixtralcap-dp4-ep2-z1", 1, EP2),
            moe_case("mixtralcap-pp2-dp2-ep2-z3", 3, "parallel.pp=2", EP2),
            moe_case("qwen3moecap-dp4-ep2-z1", 1, EP2),
            *resume_cases(tmp_path / "w4"),
        ],
    )
    check_resume(got)
    check_inspect(tmp_path / "w4")
    check_router_load(got)
    check_state_bytes(got)
    for row, ref in zip(got.pop("mixtral-dp4-ep2-z2-bf16"), refs["mixtral-ref"], strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-2), row["step"]
    for name, rows in got.items():
        ref = refs[f"{name.split('-')[0]}-ref"]
        assert_same(rows, ref, name)
        if "moe_dropped_tokens" in ref[0] or "moe_dropped_tokens" in rows[0]:
            drops = [r["moe_dropped_tokens"] for r in rows]
            blocks = MOE_BLOCKS[name.split("-")[0]]
            assert drops == [
                {**dict.fromkeys(blocks, 0), **r["moe_dropped_tokens"]} for r in ref
            ], name  # the same rows dropped, layer by layer
            assert all(sum(d.values()) > 0 for d in drops), drops  # the cap bites at 1.0
        if "moe_aux_loss" in ref[0] or "moe_aux_loss" in rows[0]:  # part of the loss compared
            for got_row, want in zip(rows, ref, strict=True):
                assert got_row["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=RTOL)
                assert want["moe_aux_loss"] > 0.1, want  # 0.2 x (k = 2 at perfect balance)


def resume_cases(root) -> list[dict]:
    ten, pp2 = "train.steps=10", "parallel.pp=2"
    saved = os.path.join(root, "qwen3moe-halves", "checkpoints", "step_00000005")
    rest = moe_case("qwen3moe-halves", 3, pp2, EP2, ten)
    rest["name"] = "qwen3moe-halves-rest"
    return [
        moe_case("qwen3moe-straight", 3, pp2, EP2, ten, "checkpoint.resume=never"),
        moe_case("qwen3moe-halves", 3, pp2, EP2),
        rest,
        moe_case(
            "qwen3moe-to-pp1-dp4-ep4-z1", 1, ten, "parallel.ep=4", f"checkpoint.resume={saved}"
        ),
        moe_case("qwen3moe-to-tp2-dp2-ep1-z2", 2, ten, TP2, f"checkpoint.resume={saved}"),
    ]


MOE_BLOCKS = {
    "mixtral": ["0", "1", "2", "3"],
    "mixtralaux": ["0", "1", "2", "3"],
    "mixtralcap": ["0", "1", "2", "3"],
    "qwen3moecap": ["1", "2", "3"],
    "qwen3moe": ["1", "2", "3"],
    "qwen3moeaux": ["1", "2", "3"],
}  # qwen3: 0 dense


def check_router_load(got: dict) -> None:
    """metrics rows count each MoE layer's tokens per expert: each of the step's 16 x 64 tokens
    once per top-2 choice (dropless), whatever the layout, not again when activation
    checkpointing recomputes a block nor under ZB-H1's split backward. With ep > 1 some of those
    rows went to another rank: about 1 - 1/ep of them, as the routers spread tokens about evenly
    over experts (ep=1: no exchange, no count)."""
    for name, rows in got.items():
        ep = next((int(p[2:]) for p in name.split("-") if p.startswith("ep")), 1)
        for row in rows:
            load = row["moe_tokens_per_expert"]
            assert sorted(load) == MOE_BLOCKS[name.split("-")[0]], name
            for counts in load.values():
                assert sum(counts) == 16 * 64 * 2 and len(counts) in (4, 8), (name, counts)
            if ep == 1:
                assert "moe_rows_sent" not in row, name
                continue
            assert sorted(row["moe_rows_sent"]) == sorted(load), name
            for sent in row["moe_rows_sent"].values():
                assert abs(sent / (16 * 64 * 2) - (1 - 1 / ep)) < 0.2, (name, sent)


def check_state_bytes(got: dict) -> None:
    """With ep=2 a rank keeps half of the experts, sharded over the 2 ranks holding the same
    ones: its model-state bytes after a step (metrics' `memory_live_bytes`, counted from
    DeepSpeed's own tensors) are the formula's to the byte (`model_state_bytes` with experts /
    ep over dp / ep), without the gradients ZeRO-1 frees after its step. Held as ep=1 holds
    them (whole expert tensors), ZeRO-1's parameters alone would be 4 x 294,912 B more."""
    from dsnd.config.load import load
    from dsnd.config.resolve import resolve
    from dsnd.plan.memory import model_state_bytes

    for name, stage, sets, freed in (
        ("mixtralcap-dp4-ep2-z1", 1, (EP2,), ("grads",)),
        ("qwen3moe-dp4-ep2-z3", 3, (EP2,), ()),
    ):
        res = resolve(load(None, moe_case(name, stage, *sets)["sets"]), 4)
        psi, experts = res.plan.stage_parameters(res.model)[0], res.plan.stage_experts(res.model)[0]
        assert experts > psi / 2, (name, psi, experts)  # the experts are most of the model
        parts = model_state_bytes(stage, psi, 4, False, experts=experts, ep=2)["device"]
        want = sum(v for k, v in parts.items() if k not in freed)
        assert {r["memory_live_bytes"] for r in got[name]} == {want}, (name, want)


def check_inspect(root) -> None:
    """`dsnd ckpt inspect` lists each MoE layer's experts as stored: Qwen3-MoE-tiny's blocks 1-3
    (global layers 2-4; block 0 is dense), 8 experts of width 32 over hidden 64."""
    from dsnd.commands.ckpt import format_report, report

    r = report(os.path.join(root, "qwen3moe-halves", "checkpoints", "step_00000005"))
    files = [f"layer_00{i}-model.safetensors" for i in (2, 3, 4)]
    assert [e["file"] for e in r["experts"]] == files
    for layer in r["experts"]:
        assert sorted(layer["tensors"].values()) == [[8, 64, 32], [8, 64, 64]]
    assert "experts layer_002  8 experts: down_proj [8, 64, 32], gate_up_proj [8, 64, 64]" in (
        format_report(r)
    )


def check_resume(got: dict) -> None:
    """Pops the resume cases from `got` once checked."""
    full = got.pop("qwen3moe-straight")
    first, rest = got.pop("qwen3moe-halves"), got.pop("qwen3moe-halves-rest")
    reshaped = [got.pop("qwen3moe-to-pp1-dp4-ep4-z1"), got.pop("qwen3moe-to-tp2-dp2-ep1-z2")]
    assert [r["step"] for r in full] == list(range(1, 11))
    assert [r["step"] for r in rest] == list(range(6, 11))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in first + rest] == [r[key] for r in full], key
        for other in reshaped:
            assert [r["step"] for r in other] == list(range(6, 11))
            for got_row, want in zip(other, full[5:], strict=True):
                assert abs(got_row[key] - want[key]) <= RTOL * abs(want[key]), (key, got_row)
