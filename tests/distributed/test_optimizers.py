"""DeepSpeed's other optimizers inside pipeline stages: parity with torch, and exact resume.

One 4-rank job, pp=2 x dp=2 (starting ranks costs seconds, so every case shares it). Each
optimizer DeepSpeed builds here that is not Adam, at some ZeRO stage, equals the single-process
reference with the same torch optimizer (tests/reference.py; Lion: its hand-written Lion) within
1e-4 for 5 steps:
- SGD with momentum and weight decay, ZeRO-1 (`zero_allow_untested_optimizer`, as DeepSpeed asks);
- Adagrad, ZeRO-0 (torch.optim.Adagrad; ZeRO 1-3 are refused) and ZeRO-3 offloaded
  (DeepSpeedCPUAdagrad);
- Lion, ZeRO-1 offloaded (DeepSpeedCPULion: the only Lion without a CUDA kernel);
- RMSprop with momentum and centered, NAdam, ZeRO-2 and ZeRO-3.
And 5 steps + save + resume 5 equal 10 straight bit for bit for SGD (momentum_buffer, no step
count), NAdam (its mu_product replayed on resume) and CPU Lion (a Python-int step count); torch's
Adagrad's checkpoint (ZeRO-0, its `sum`) resumed offloaded (DeepSpeedCPUAdagrad, which calls it
`exp_avg_sq`) at ZeRO-3 continues the reference's steps 6-10 within 1e-4.

DeepSpeed JIT-builds its CPU Adagrad and Lion ops the first time an environment uses them.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed.parity import RTOL, STEPS, assert_same, case, run_cases
from tests.distributed.test_checkpoint_resume import _assert_exact, _exact_cases
from tests.distributed.test_offload import _basic_optimizer

PP2 = ("parallel.pp=2",)
UNTESTED = "ds.zero_allow_untested_optimizer=true"
OFFLOAD = 'ds.zero_optimization.offload_optimizer={"device": "cpu"}'


def _optimizer(kind: str, **params) -> str:
    return "ds.optimizer=" + json.dumps({"type": kind, "params": {"lr": 0.003, **params}})


SGD = _optimizer("SGD", momentum=0.9, weight_decay=0.1)
ADAGRAD = _optimizer("Adagrad", weight_decay=0.1, lr=0.01)
LION = _optimizer("Lion", betas=[0.9, 0.99], weight_decay=0.1, lr=0.001)
RMSPROP = _optimizer("RMSprop", momentum=0.5, centered=True, weight_decay=0.1, lr=0.001)
NADAM = _optimizer("NAdam", betas=[0.9, 0.95], weight_decay=0.1)

# name -> (ZeRO stage, --set items, the class DeepSpeed logs, the reference's optimizer)
PARITY = {
    "adagrad-z0": (0, (ADAGRAD,), "Adagrad", ADAGRAD),
    "adagrad-z3-offload": (3, (ADAGRAD, OFFLOAD), "DeepSpeedCPUAdagrad", ADAGRAD),
    "rmsprop-z2": (2, (RMSPROP, UNTESTED), "RMSprop", RMSPROP),
}
# the same, run as 10 straight steps (whose first 5 are compared) and 5 + save + resume 5
EXACT = {
    "sgd-z1": (1, (SGD, UNTESTED), "SGD", SGD),
    "nadam-z3": (3, (NADAM, UNTESTED), "NAdam", NADAM),
    "lion-z1-offload": (1, (LION, OFFLOAD), "DeepSpeedCPULion", LION),
}


@pytest.mark.dist
def test_optimizers_match_torch_and_resume_exactly(tmp_path):
    # one reference per optimizer, resolved with the sets of a case that uses it (offload:
    # the JSON check needs it for Lion; the reference reads only the optimizer and scheduler);
    # Adagrad's runs 10 steps, for the checkpoint resumed across offload
    uses = {opt: (stage, sets) for stage, sets, _, opt in [*PARITY.values(), *EXACT.values()]}
    references = {opt: f"ref-{json.loads(opt.split('=', 1)[1])['type']}" for opt in uses}
    saved = os.path.join(tmp_path, "adagrad-z0", "checkpoints", "step_00000005")
    across = case(
        "adagrad-z0-to-offload-z3",
        3,
        sets=(*PP2, ADAGRAD, OFFLOAD, "train.steps=10", f"checkpoint.resume={saved}"),
    )
    got = run_cases(
        tmp_path,
        4,
        [
            *(
                case(references[opt], stage, reference=True, sets=(*sets, f"train.steps={steps}"))
                for opt, (stage, sets) in uses.items()
                for steps in [10 if opt == ADAGRAD else STEPS]
            ),
            *(case(name, stage, sets=(*PP2, *sets)) for name, (stage, sets, *_) in PARITY.items()),
            *(
                c
                for tag, (stage, sets, *_) in EXACT.items()
                for c in _exact_cases(tag, stage, *PP2, *sets)
            ),
            across,
        ],
    )
    runs = {**{name: name for name in PARITY}, **{tag: f"straight-{tag}" for tag in EXACT}}
    for name, (_, _, built, opt) in {**PARITY, **EXACT}.items():
        assert_same(got[runs[name]][:STEPS], got[references[opt]][:STEPS], name)
        assert _basic_optimizer(tmp_path, runs[name]) == built, name  # what the case claims
    for tag in EXACT:
        _assert_exact(got, tag)
    rows, want = got["adagrad-z0-to-offload-z3"], got[references[ADAGRAD]][STEPS:]
    assert [r["step"] for r in rows] == list(range(6, 11))
    for row, ref in zip(rows, want, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert row[key] == pytest.approx(ref[key], rel=RTOL), (row["step"], key)
