"""fp16 pieces that run without fp16 kernels: the skip-agreement check, the JSON check of the
fp16 section on this CPU, and checkpoints from before the loss scaler was saved (the fp16 path
itself runs in tests/distributed/test_fp16.py)."""

from __future__ import annotations

import pytest
import torch

from dsnd.config.load import load
from dsnd.errors import UserError, problems_of
from dsnd.report.telemetry import STATS, check_skips_agree


def _stats(skipped: list[bool]) -> torch.Tensor:
    stats = torch.zeros(len(skipped), len(STATS), dtype=torch.float64)
    stats[:, STATS.index("step_skipped")] = torch.tensor([float(s) for s in skipped])
    return stats


@pytest.mark.parametrize("skipped", [[False] * 4, [True] * 4])
def test_ranks_that_agree_on_a_skip_pass(skipped):
    check_skips_agree(_stats(skipped))


def test_ranks_that_disagree_on_a_skip_stop_the_run():
    with pytest.raises(
        RuntimeError,
        match=r"ranks \[1, 3\] skipped the optimizer step "
        r"\(gradient overflow\) and the other ranks of 4",
    ):
        check_skips_agree(_stats([False, True, False, True]))


def test_fp16_on_this_cpu_is_refused_with_deepspeeds_reason_and_every_typo_at_once():
    with pytest.raises(UserError) as e:
        load(None, ['ds.fp16={"enabled": true, "initial_scale_powr": 12}'])
    lines = problems_of(e.value)
    assert any(
        "fp16 is not supported on this device (DeepSpeed: Type fp16 is not supported "
        "on your device); use bf16 or fp32" in line
        for line in lines
    ), lines
    assert any(
        "fp16: unknown key 'initial_scale_powr' (did you mean 'initial_scale_power'?)" in line
        for line in lines
    ), lines


def test_a_disabled_fp16_section_is_checked_and_noted_not_refused():
    res_ds = load(None, ['ds.fp16={"enabled": false, "loss_scale_window": 500}']).ds
    assert res_ds["fp16"] == {"enabled": False, "loss_scale_window": 500}
    with pytest.raises(UserError, match="fp16: unknown key 'loss_scale_windw'"):
        load(None, ['ds.fp16={"enabled": false, "loss_scale_windw": 500}'])
