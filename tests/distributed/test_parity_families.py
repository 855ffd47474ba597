"""Every family trains the same on 4-rank layouts as in one plain PyTorch process: real-size
presets reduced to width 64 (rope settings, norms, biases, tying, q/k norms unchanged), each
family on pp=2 x tp=2 and on tp=2 x dp=2, one with ZeRO-1 and the other with ZeRO-3; Qwen2.5
(tied head, q/k/v biases) also under sequence parallelism and on pp=2 x tp=2 x dp=2 (8 ranks).
Losses, gradient norms and learning rates within 1e-4 relative over five steps.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import assert_same, assert_same_as_references, case, run_cases

TP2 = ("parallel.tp=2",)
PP2_TP2 = ("parallel.pp=2", "parallel.tp=2")
SP = ("parallel.sequence_parallel=true",)
FAMILIES = {  # family -> the preset that stands for it (Llama 3.2: tied, llama3 rope scaling)
    "mistral": "mistral-7b",
    "qwen2": "qwen2.5-0.5b",
    "qwen3": "qwen3-0.6b",
    "llama32": "llama-3.2-1b",
}


def reduced(preset: str) -> tuple[str, ...]:
    """--set items shrinking `preset` to 4 blocks of width 64 over the byte vocabulary."""
    return (
        f"model.preset={preset}",
        "model.hidden_size=64",
        "model.num_layers=4",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_size=128",
        "model.vocab_size=256",
    )


def family_case(name: str, zero: int | None, *sets: str, reference: bool = False) -> dict:
    family = name.split("-")[0]
    return case(name, zero, FAMILIES[family], reference, (*reduced(FAMILIES[family]), *sets))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families-w1")
    return run_cases(tmp, 1, [family_case(f"{f}-ref", None, reference=True) for f in FAMILIES])


def _check(got: dict, refs: dict) -> None:
    for name, rows in got.items():
        assert_same(rows, refs[f"{name.split('-')[0]}-ref"], name)


@pytest.mark.dist
def test_each_family_on_pp2_tp2_and_tp2_dp2(references, tmp_path):
    got = run_cases(
        tmp_path,
        4,
        [
            family_case("mistral-pp2-tp2-z1", 1, *PP2_TP2),
            family_case("mistral-tp2-dp2-z3", 3, *TP2),
            family_case("qwen2-pp2-tp2-z3", 3, *PP2_TP2),
            family_case("qwen2-tp2-dp2-sp-z1", 1, *TP2, *SP),
            family_case("qwen3-pp2-tp2-z1", 1, *PP2_TP2),
            family_case("qwen3-tp2-dp2-z3", 3, *TP2),
            family_case("llama32-pp2-tp2-sp-z3", 3, *PP2_TP2, *SP),
        ],
    )
    _check(got, references)


@pytest.mark.dist
def test_pp2_tp2_dp2_on_eight_ranks_llama_and_qwen2_tied_with_biases(references, single, tmp_path):
    """Eight ranks start once for both: llama-tiny at ZeRO-1, Qwen2.5 (its head tied to the
    embedding across the two stages, q/k/v biases) at ZeRO-3 under sequence parallelism."""
    got = run_cases(
        tmp_path,
        8,
        [
            case("tp2-pp2-dp2-z1", 1, sets=PP2_TP2),
            family_case("qwen2-pp2-tp2-dp2-sp-z3", 3, *PP2_TP2, *SP),
        ],
    )
    assert_same_as_references({"tp2-pp2-dp2-z1": got.pop("tp2-pp2-dp2-z1")}, single)
    _check(got, references)
