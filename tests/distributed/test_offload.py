"""ZeRO-Offload to the CPU inside pipeline stages: parity, exact resume, and resuming across it.

One 4-rank job, pp=2 x dp=2 (starting ranks costs seconds, so every case shares it):
- ZeRO-3 with parameters and optimizer offloaded, DeepSpeedCPUAdam (the JSON's `torch_adam`
  deleted): its first 5 steps equal the single-process reference within 1e-4, and 5 steps + save
  + resume 5 equal 10 straight, bit for bit (only with dsnd.engine.compat.replay_cpu_adam_steps:
  the op's beta powers otherwise differ in the last bit after a resume).
- ZeRO-2 with the optimizer offloaded and the packaged JSON's `torch_adam: true` (torch's AdamW
  on the offloaded partition): the reference within 1e-4.
- An offloaded checkpoint resumed without offload (ZeRO-3), and a checkpoint saved without
  offload (ZeRO-3) resumed with the optimizer offloaded (ZeRO-1, DeepSpeedCPUAdam): both continue
  the uninterrupted run within 1e-4.
- NVMe offload (ZeRO-Infinity) of parameters and optimizer into a directory, ZeRO-3,
  DeepSpeedCPUAdam: the same run without offload within 1e-4, 5 + resume 5 = 10 straight bit for
  bit, and the swap files are there. DeepSpeed swaps only tensors of 1 MiB or more, so this case
  has a vocabulary of 8192 (embedding and head: 1 MiB per rank at dp=2); `max_in_cpu: 0` keeps
  parameters on NVMe between uses. (The single-process reference is not the yardstick here: its
  float32 per-tensor norms are 4e-5 off the float64 norm at this vocabulary, measured.)

DeepSpeed JIT-builds its CPU Adam op the first time an environment uses it (about a minute), and
the async_io op NVMe offload needs (it links libaio; several minutes).
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.parity import RTOL, STEPS, assert_same, case, run_cases
from tests.distributed.test_checkpoint_resume import _assert_exact, _exact_cases

PP2 = ("parallel.pp=2",)
OPTIMIZER = 'ds.zero_optimization.offload_optimizer={"device": "cpu"}'
PARAMS = 'ds.zero_optimization.offload_param={"device": "cpu"}'
CPU_ADAM = "ds.optimizer.params.torch_adam=null"  # no torch_adam: DeepSpeed picks DeepSpeedCPUAdam
VOCAB_8K = "model.vocab_size=8192"


def _nvme(path) -> tuple[str, ...]:
    """Parameters and optimizer offloaded to NVMe in `path` (made here); small swap buffers (the
    default pins 5 x 400 MB per rank)."""
    os.makedirs(path)
    return (
        f'ds.zero_optimization.offload_optimizer={{"device": "nvme", "nvme_path": "{path}"}}',
        f'ds.zero_optimization.offload_param={{"device": "nvme", "nvme_path": "{path}", '
        '"buffer_size": 1000000, "max_in_cpu": 0}',
    )


def _step5(tmp_path, name: str) -> str:
    return os.path.join(tmp_path, name, "checkpoints", "step_00000005")


def _basic_optimizer(tmp_path, name: str) -> str:
    """The optimizer class DeepSpeed logged for the case (rank 0's log)."""
    with open(os.path.join(tmp_path, name, "logs", "rank_00000.log")) as f:
        lines = [line for line in f if "DeepSpeed Basic Optimizer = " in line]
    return lines[-1].rsplit("= ", 1)[1].strip()


@pytest.mark.dist
def test_offload_parity_exact_resume_and_resume_across(single, tmp_path):
    resumed = {
        "offload-to-plain-z3": case(
            "offload-to-plain-z3",
            3,
            sets=(
                *PP2,
                "train.steps=10",
                f"checkpoint.resume={_step5(tmp_path, 'halves-z3-offload')}",
            ),
        ),
        "plain-to-offload-z1": case(
            "plain-to-offload-z1",
            1,
            sets=(
                *PP2,
                OPTIMIZER,
                CPU_ADAM,
                "train.steps=10",
                f"checkpoint.resume={_step5(tmp_path, 'plain-z3')}",
            ),
        ),
    }
    got = run_cases(
        tmp_path,
        4,
        [
            *_exact_cases("z3-offload", 3, *PP2, OPTIMIZER, PARAMS, CPU_ADAM),
            case("z2-offload-torch-adam", 2, sets=(*PP2, OPTIMIZER)),
            case("plain-z3", 3, sets=PP2),
            *resumed.values(),
            *_exact_cases("z3-nvme", 3, *PP2, *_nvme(tmp_path / "nvme"), CPU_ADAM, VOCAB_8K),
            case("plain-z3-vocab8k", 3, sets=(*PP2, VOCAB_8K)),
        ],
    )
    ref = single["ref-llama"]
    straight = got["straight-z3-offload"]
    assert_same(straight[:STEPS], ref, "straight-z3-offload")
    assert_same(got["z2-offload-torch-adam"], ref, "z2-offload-torch-adam")
    assert_same(got["plain-z3"], ref, "plain-z3")
    _assert_exact(got, "z3-offload")
    for name in resumed:
        rows = got[name]
        assert [r["step"] for r in rows] == list(range(6, 11)), name
        for row, want in zip(rows, straight[5:], strict=True):
            for key in ("loss", "grad_norm", "lr"):
                assert row[key] == pytest.approx(want[key], rel=RTOL), (name, row["step"], key)
    # the cases ran the optimizers they claim to
    assert _basic_optimizer(tmp_path, "straight-z3-offload") == "DeepSpeedCPUAdam"
    assert _basic_optimizer(tmp_path, "plain-to-offload-z1") == "DeepSpeedCPUAdam"
    assert _basic_optimizer(tmp_path, "z2-offload-torch-adam") == "AdamW"
    # NVMe
    assert_same(got["straight-z3-nvme"][:STEPS], got["plain-z3-vocab8k"], "straight-z3-nvme")
    _assert_exact(got, "z3-nvme")
    for kind in ("float32params", "optimizer"):  # DeepSpeed's swap folders, per global rank
        swapped = {f.parent.name for f in (tmp_path / "nvme" / "zero_stage_3" / kind).glob("*/*")}
        assert swapped == {f"rank{r}" for r in range(4)}, kind
    assert _basic_optimizer(tmp_path, "straight-z3-nvme") == "DeepSpeedCPUAdam"
