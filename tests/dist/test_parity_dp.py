"""Data parallel x ZeRO 0-3 equals a plain single-process PyTorch run (fp32, 1e-4 relative).

Real gloo ranks, real DeepSpeed engines; same global batch (16) for every layout.
"""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

STEPS = 5
RTOL = 1e-4


def case(name: str, stage: int | None, preset: str = "llama-tiny", reference: bool = False):
    sets = [f"train.steps={STEPS}", f"model.preset={preset}", f"log.dir=runs/test/{name}"]
    if stage is not None:
        sets.append(f"deepspeed=ds_configs/zero{stage}.json")
    return {"name": name, "sets": sets, "reference": reference}


def run_cases(tmp_path, world: int, cases: list[dict]) -> dict:
    cases_file, out = tmp_path / "cases.json", tmp_path / "out.json"
    for c in cases:
        c["sets"] = [s.replace("runs/test", str(tmp_path)) for s in c["sets"]]
    cases_file.write_text(json.dumps(cases))
    run_ranks(world, ["tests/dist/train_cases.py", str(out), str(cases_file)], timeout=400)
    return json.loads(out.read_text())


def assert_same(rows: list[dict], ref: list[dict], label: str) -> None:
    assert len(rows) == len(ref) == STEPS, label
    for got, want in zip(rows, ref):
        for key in ("loss", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (label, got["step"], key)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One rank: the plain-torch references, dsnd at ZeRO 0 and 3, and a user's JSONL corpus."""
    tmp = tmp_path_factory.mktemp("w1")
    corpus = tmp / "docs.jsonl"
    docs = [{"text": f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * 4}
            for i in range(200)]  # fmt: skip
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    jsonl = case("w1-jsonl", 0)
    jsonl["sets"].append(f"data.path={corpus}")
    return run_cases(tmp, 1, [
        case("ref-llama", None, reference=True),
        case("ref-gpt2", None, "gpt2-tiny", reference=True),
        case("w1-z0", 0),
        case("w1-z3", 3),
        case("w1-gpt2-z0", 0, "gpt2-tiny"),
        jsonl,
    ])  # fmt: skip


@pytest.mark.dist
def test_single_rank_matches_plain_pytorch(single):
    assert_same(single["w1-z0"], single["ref-llama"], "llama z0 world 1")
    assert_same(single["w1-z3"], single["ref-llama"], "llama z3 world 1")
    assert_same(single["w1-gpt2-z0"], single["ref-gpt2"], "gpt2 z0 world 1")


@pytest.mark.dist
def test_trains_on_a_jsonl_corpus(single):
    rows = single["w1-jsonl"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # a repetitive corpus is learnt fast, and it is not the default corpus
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert rows[-1]["loss"] != pytest.approx(single["w1-z0"][-1]["loss"], rel=1e-3)


@pytest.mark.dist
def test_two_ranks_zero_0_to_3_match_single_process(single, tmp_path):
    got = run_cases(tmp_path, 2, [
        case("w2-z0", 0), case("w2-z1", 1), case("w2-z2", 2), case("w2-z3", 3),
        case("w2-gpt2-z3", 3, "gpt2-tiny"),
    ])  # fmt: skip
    for stage in range(4):
        assert_same(got[f"w2-z{stage}"], single["ref-llama"], f"llama z{stage} world 2")
    assert_same(got["w2-gpt2-z3"], single["ref-gpt2"], "gpt2 (tied) z3 world 2")
    # the run learns: loss falls over the five steps
    assert got["w2-z3"][-1]["loss"] < got["w2-z3"][0]["loss"]
