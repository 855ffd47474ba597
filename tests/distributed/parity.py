"""Shared pieces of the parity tests: cases, a run of them in one set of ranks, the comparison."""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ranks

STEPS = 5
RTOL = 1e-4


def case(
    name: str,
    stage: int | None,
    preset: str = "llama-tiny",
    reference: bool = False,
    sets: tuple[str, ...] = (),
) -> dict:
    """A training case: `stage` picks ds_configs/zero<stage>.json; `sets` adds --set items."""
    # one held-out batch (not 2) in the end-of-run evaluation: the cases compare the training
    # losses; tests/distributed/test_eval.py compares evaluations across layouts (with its own)
    all_sets = [
        f"train.steps={STEPS}",
        f"model.preset={preset}",
        f"log.dir=runs/test/{name}",
        "eval.batches=1",
    ]
    if stage is not None:
        all_sets.append(f"deepspeed=ds_configs/zero{stage}.json")
    return {"name": name, "sets": [*all_sets, *sets], "reference": reference}


def run_cases(
    tmp_path, world: int, cases: list[dict], worker: str = "tests/distributed/train_cases.py"
) -> dict:
    cases_file, out = tmp_path / "cases.json", tmp_path / "out.json"
    for c in cases:
        c["sets"] = [s.replace("runs/test", str(tmp_path)) for s in c["sets"]]
    cases_file.write_text(json.dumps(cases))
    run_ranks(world, [worker, str(out), str(cases_file)], timeout=400)
    return json.loads(out.read_text())


def assert_same_as_references(got: dict, single: dict, skip: tuple[str, ...] = ()) -> None:
    """Every case of `got` (but names starting with one of `skip`) equals the single-process
    reference of its family: "gpt2-..." cases GPT-2's, the others Llama's."""
    for name, rows in got.items():
        if not name.startswith(skip):
            assert_same(rows, single["ref-gpt2" if name.startswith("gpt2") else "ref-llama"], name)


def assert_same(rows: list[dict], ref: list[dict], label: str) -> None:
    assert len(rows) == len(ref) == STEPS, label
    for got, want in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=RTOL), (label, got["step"], key)
