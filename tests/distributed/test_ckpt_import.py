"""`dsnd ckpt import`: checkpoints DeepSpeed's own engines saved, continued by dsnd on other
layouts, equal the uninterrupted DeepSpeed runs.

1. One 4-rank job (`ds_native_worker.py`) trains with DeepSpeed alone, from the same JSONs,
   initial weights and samples dsnd uses: a plain `DeepSpeedEngine` over the whole model at
   ZeRO-3 (dp=4, llama-tiny), and a `PipelineEngine` (`PipelineModule` over dsnd's layer specs)
   at ZeRO-1, pp=2 x dp=2 (gpt2-tiny: its tied embedding lives on both stages). ZeRO-2 writes
   the files ZeRO-1 does (measured: a ZeRO-2 plain engine imported and continued alike), so it
   is left out to keep the test short. Each saves with `save_checkpoint` after SAVE_AT steps
   and runs on to STEPS.
2. `dsnd ckpt import` (the CLI's entry point) converts each; the result passes `verify`. The
   pipeline's checkpoint imported for another model is refused in one line, nothing written.
3. One 4-rank dsnd job continues each import at pp=2 x dp=2 ZeRO-3 and at tp=2 x dp=2 ZeRO-1:
   steps SAVE_AT+1..STEPS must equal DeepSpeed's own (loss, gradient norm and learning rate
   within rel 1e-4). The warmup ends inside them, so the LR schedule's state moves too; without
   the Adam moments or with Adam's step count off, the losses would differ from the first
   continued step on.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from dsnd import cli
from dsnd.checkpoint.verify import verify
from dsnd.engine import ds_checkpoint
from tests.distributed.parity import RTOL, case, run_cases

STEPS, SAVE_AT = 6, 3
SOURCES = {  # name: (engine, JSON, preset)
    "plain-z3": ("plain", "ds_configs/zero3.json", "llama-tiny"),
    "pipe-z1": ("pipe", "ds_configs/zero1.json", "gpt2-tiny"),  # last: it sets DeepSpeed's mpu
}
LAYOUTS = {  # dsnd layout the import continues on: (ZeRO stage, --set items)
    "pp2-dp2-z3": (3, ("parallel.pp=2",)),
    "tp2-dp2-z1": (1, ("parallel.tp=2",)),
}


@pytest.mark.dist
def test_deepspeed_checkpoints_continue_in_dsnd(tmp_path, capsys):
    ds_cases = [
        {
            "name": name,
            "engine": engine,
            "json": json_path,
            "sets": [f"model.preset={p}"],
            "steps": STEPS,
            "save_at": SAVE_AT,
            "save_dir": str(tmp_path / f"ds-{name}"),
        }
        for name, (engine, json_path, p) in SOURCES.items()
    ]
    (tmp_path / "ds").mkdir()
    theirs = run_cases(tmp_path / "ds", 4, ds_cases, worker="tests/distributed/ds_native_worker.py")

    cases = []
    for name, (_, _, preset) in SOURCES.items():
        out = str(tmp_path / f"dsnd-{name}")
        rc = cli.main(
            ["ckpt", "import", str(tmp_path / f"ds-{name}"), out, "--set", f"model.preset={preset}"]
        )
        said = capsys.readouterr()
        assert rc == 0, said.err
        assert said.out.startswith(f"wrote {out}/step_{SAVE_AT:08d}: step {SAVE_AT} of "), said.out
        assert verify(os.path.join(out, f"step_{SAVE_AT:08d}")) == []
        for layout, (zero, sets) in LAYOUTS.items():
            cases.append(
                case(
                    f"{name}-to-{layout}",
                    zero,
                    preset,
                    sets=(*sets, f"train.steps={STEPS}", f"checkpoint.resume={out}"),
                )
            )
    # the pipeline's checkpoint for another model: refused by name, nothing written
    other = str(tmp_path / "refused")
    rc = cli.main(
        ["ckpt", "import", str(tmp_path / "ds-pipe-z1"), other, "--set", "model.preset=llama-tiny"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and not os.path.exists(other), err
    assert err.endswith(
        "global_step3: the checkpoint has 1 tied module(s) (tied_modules.embed) but preset "
        "llama-tiny has 0 (tie_word_embeddings=False)\n"
    ), err
    _refuses_numbers_dsnd_cannot_resume(tmp_path, capsys)
    (tmp_path / "dsnd").mkdir()
    ours = run_cases(tmp_path / "dsnd", 4, cases)

    for name in SOURCES:
        want = theirs[name][SAVE_AT:]
        assert [r["step"] for r in want] == list(range(SAVE_AT + 1, STEPS + 1)), name
        for layout in LAYOUTS:
            label = f"{name}-to-{layout}"
            rows = ours[label]
            assert [r["step"] for r in rows] == [r["step"] for r in want], label
            for got, ref in zip(rows, want, strict=True):
                for key in ("loss", "grad_norm", "lr"):
                    assert got[key] == pytest.approx(ref[key], rel=RTOL), (label, got["step"], key)


def _edited(source, out, pattern: str, edit) -> str:
    """A copy of the DeepSpeed checkpoint `source` with `edit(state)` applied to every file of
    its tag matching `pattern`; the copied tag directory."""
    shutil.copytree(source, out)
    tag = os.path.join(out, f"global_step{SAVE_AT}")
    for path in glob.glob(os.path.join(tag, pattern)):
        state = ds_checkpoint.load(path)
        edit(state)
        torch.save(state, path)
    return tag


def _set_lr(state: dict, lr: float) -> None:
    inner = state["optimizer_state_dict"]
    groups = (inner.get("base_optimizer_state") or inner["optimizer_state_dict"])["param_groups"]
    for group in groups:
        group["lr"] = lr


def _optimizer_state(state: dict) -> dict:
    """The optimizer's per-group state of a ZeRO-1/2 or ZeRO-3 optimizer file."""
    inner = state["optimizer_state_dict"]
    return (inner.get("base_optimizer_state") or inner["optimizer_state_dict"])["state"]


def _nan_moment(state: dict) -> None:
    _optimizer_state(state)[0]["exp_avg"][0] = float("nan")


def _text_step(state: dict) -> None:
    for entry in _optimizer_state(state).values():
        entry["step"] = "3"


STEP_RULE = "expected a non-negative integer (an int, or a one-element tensor holding one)"


def _refuses_numbers_dsnd_cannot_resume(tmp_path, capsys) -> None:
    """Numbers edited in the files DeepSpeed saved: a NaN learning rate (ZeRO-3 and ZeRO-1's
    optimizer files), a step beyond what a step directory's name holds and a scheduler position
    before its start (model-state files), a NaN Adam moment and a step count "3" (optimizer
    files, read through DeepSpeed's conversion): one line naming the DeepSpeed file and key,
    nothing written."""
    bad = {  # name: (source, files, edit, what the refusal names)
        "nan-lr-z3": (
            "plain-z3",
            "*_optim_states.pt",
            lambda s: _set_lr(s, float("nan")),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            "optimizer_state_dict.param_groups[0].lr' is nan, expected a finite "
            "number >= 0",
        ),
        "nan-lr-z1": (
            "pipe-z1",
            "*_optim_states.pt",
            lambda s: _set_lr(s, float("nan")),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            "base_optimizer_state.param_groups[0].lr' is nan, expected a finite "
            "number >= 0",
        ),
        "str-lr-z1": (
            "pipe-z1",
            "*_optim_states.pt",
            lambda s: _set_lr(s, "0.1"),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            "base_optimizer_state.param_groups[0].lr' is '0.1', expected a finite "
            "number >= 0",
        ),
        "step-1e12": (
            "plain-z3",
            "*_model_states.pt",
            lambda s: s.update(global_steps=10**12),
            "zero_pp_rank_0_mp_rank_00_model_states.pt: 'global_steps' is "
            "1000000000000, expected an integer in [0, 99999999] (a step "
            "directory's name holds 8 digits)",
        ),
        "sched-1e9": (
            "pipe-z1",
            "mp_rank_*_model_states.pt",
            lambda s: s["lr_scheduler"].update(last_batch_iteration=-(10**9)),
            "mp_rank_00_model_states.pt: 'lr_scheduler.last_batch_iteration' is "
            "-1000000000, expected an integer in [-1, 99999999]",
        ),
        "nan-moment-z1": (
            "pipe-z1",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            _nan_moment,
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            "base_optimizer_state.state[0].exp_avg' holds NaN or infinite values "
            "(DeepSpeed's conversion carried them into parameter "
            "1.attn.c_attn.weight's exp_avg); dsnd continues only a finite state",
        ),
        "text-step-z3": (
            "plain-z3",
            "*_optim_states.pt",
            _text_step,
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            f"optimizer_state_dict.state[0].step' is '3', {STEP_RULE}",
        ),
        "text-step-z1": (
            "pipe-z1",
            "*_optim_states.pt",
            _text_step,
            "zero_pp_rank_0_mp_rank_00_optim_states.pt: 'optimizer_state_dict."
            f"base_optimizer_state.state[0].step' is '3', {STEP_RULE}",
        ),
    }
    for name, (source, pattern, edit, what) in bad.items():
        tag = _edited(tmp_path / f"ds-{source}", tmp_path / f"bad-{name}", pattern, edit)
        out = tmp_path / f"refused-{name}"
        preset = SOURCES[source][2]
        rc = cli.main(["ckpt", "import", tag, str(out), "--set", f"model.preset={preset}"])
        err = capsys.readouterr().err
        assert (rc, err) == (2, f"dsnd: error: {tag}/{what}\n"), name
        assert not out.exists() and not glob.glob(str(tmp_path / ".dsnd-import-*")), name
