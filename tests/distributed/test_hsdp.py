"""Hybrid sharding (`parallel.dp_shard`, dsnd/engine/hsdp.py) in one 4-rank job:

- pp=1 x dp=4, dp_shard=2 (ZeRO-3 over ranks [0, 1] and [2, 3], gradients averaged over [0, 2]
  and [1, 3]): the first 5 steps equal the single-process reference within 1e-4, and each rank
  holds the model states of ZeRO-3 over 2 ranks, not 4 — its largest rank's bytes divided by
  DeepSpeed's ZeRO-3 fp32 formula (4 params + 4 grads + 4 master + 8 Adam) * Psi / dp_shard
  is near 1.
- Its step-5 checkpoint resumed on plain ZeRO-3 (dp=4, no dp_shard): steps 6..10 equal the
  HSDP run's own within 1e-4 (checkpoints hold no layout).
- pp=2 x dp=2, dp_shard=1 (each stage's ranks hold their whole stage and average gradients),
  and dp_shard=2 with the optimizer and parameters offloaded to the CPU (the gradient
  partitions are averaged before ZeRO-3 offloads them): the reference within 1e-4.
"""

from __future__ import annotations

import os

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.plan.memory import model_state_bytes
from tests.distributed.parity import RTOL, STEPS, assert_same, case, run_cases
from tests.procs import last_log_text

SHARD2 = ("parallel.dp_shard=2",)
OFFLOAD = (
    'ds.zero_optimization.offload_optimizer={"device": "cpu"}',
    'ds.zero_optimization.offload_param={"device": "cpu"}',
)


@pytest.mark.dist
def test_hsdp_parity_memory_and_resume_on_plain_zero3(single, tmp_path):
    saved = os.path.join(tmp_path, "hsdp", "checkpoints", "step_00000005")
    hsdp = case("hsdp", 3, sets=(*SHARD2, "train.steps=10", "checkpoint.every=5"))
    got = run_cases(
        tmp_path,
        4,
        [
            hsdp,
            case("hsdp-to-plain", 3, sets=("train.steps=10", f"checkpoint.resume={saved}")),
            case("hsdp-pp2-shard1", 3, sets=("parallel.pp=2", "parallel.dp_shard=1")),
            case("hsdp-offload", 3, sets=(*SHARD2, *OFFLOAD)),
        ],
    )
    ref = single["ref-llama"]
    assert_same(got["hsdp"][:STEPS], ref, "hsdp")
    assert_same(got["hsdp-pp2-shard1"], ref, "hsdp-pp2-shard1")
    assert_same(got["hsdp-offload"], ref, "hsdp-offload")

    resumed, straight = got["hsdp-to-plain"], got["hsdp"][STEPS:]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    for a, b in zip(resumed, straight, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == pytest.approx(b[key], rel=RTOL), ("hsdp-to-plain", a["step"], key)

    want = [
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [1, 3]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [1, 3]",
    ]
    assert [last_log_text(tmp_path / "hsdp", r, "HSDP: ") for r in range(4)] == want

    res = resolve(load(None, hsdp["sets"]), 4)
    psi = res.plan.stage_parameters(res.model)[0]
    formula = sum(model_state_bytes(3, psi, 2, bf16=False)["device"].values())
    ratio = max(r["memory_live_bytes"] for r in got["hsdp"]) / formula
    print(f"HSDP dp=4 dp_shard=2: model-state bytes per rank / (20 * {psi} / 2) = {ratio:.3f}")
    assert 0.95 < ratio < 1.10, ratio
