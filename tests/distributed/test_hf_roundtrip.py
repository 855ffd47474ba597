"""`model.init_from` / `checkpoint.export_hf`: a transformers checkpoint in, the same model out.

HF weights (seeded, then perturbed so they are not dsnd's init) go into dsnd at pp=2 x dp=1,
pp=1 x dp=2 and tp=2 x pp=2 (each stage reads its own tensors, each tensor-parallel rank its own
shard), come back out through `export_hf` (every stage gathered to rank 0, shards joined) and
load with `AutoModelForCausalLM.from_pretrained`: the logits equal the original's. One case
trains a step first, so the export must differ: it reads the trained weights.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsnd.errors import UserError
from dsnd.model import build_model
from dsnd.model.hf_io import check_init_from, write_hf_dir
from tests.distributed.parity import run_cases
from tests.models import spec_of
from tests.procs import last_log_text


def _hf_model(preset: str) -> torch.nn.Module:
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(spec_of(preset).config).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _case(name: str, preset: str, zero: int, src, out, steps: int, pp: int, *extra: str) -> dict:
    sets = [
        f"model.preset={preset}",
        f"deepspeed=ds_configs/zero{zero}.json",
        f"parallel.pp={pp}",
        f"train.steps={steps}",
        f"checkpoint.export_hf={out}",
        f"log.dir=runs/test/{name}",
        *extra,
    ]
    if src is not None:
        sets.append(f"model.init_from={src}")
        if steps:  # a fine-tune's default linear decay has no warm-up, which DeepSpeed's
            # schedulers run as two steps at lr 0 (dsnd.config.lr_schedule): train at a rate
            sets += ["train.lr=1e-3", "train.lr_decay=constant"]
    return {"name": name, "sets": sets}


def _check_export(path, model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> None:
    exported, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], (path, info)
    assert type(exported) is type(model), path
    diff = (_logits(exported.eval(), tokens) - _logits(model, tokens)).abs().max().item()
    if steps == 0:
        assert diff < 1e-5, (path, diff)
    else:  # training moved the weights, and the export saw it
        assert diff > 1e-3, (path, diff)
        before = model.state_dict()
        changed = [k for k, v in exported.state_dict().items() if not torch.equal(v, before[k])]
        assert len(changed) == len(before), (path, sorted(set(before) - set(changed)))


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.dist
def test_hf_checkpoint_roundtrip_through_pipeline_stages(tmp_path):
    models, cases = {}, []
    for preset in ("llama-tiny", "gpt2-tiny"):
        models[preset] = _hf_model(preset)
        models[preset].save_pretrained(tmp_path / f"in-{preset}")
    plan = [
        # name, preset, ZeRO stage, train.steps, pp (dp = 2 / pp)
        ("llama-z0", "llama-tiny", 0, 0, 2),
        ("gpt2-z0", "gpt2-tiny", 0, 0, 2),
        ("gpt2-z3", "gpt2-tiny", 3, 0, 2),  # tied weight owned by stage 0, under ZeRO-3
        ("llama-z3", "llama-tiny", 3, 0, 2),
        ("llama-dp2-z3", "llama-tiny", 3, 0, 1),  # shards gathered over the data group
        ("llama-z0-trained", "llama-tiny", 0, 1, 2),
    ]
    for name, preset, zero, steps, pp in plan:
        src = tmp_path / f"in-{preset}"
        cases.append(_case(name, preset, zero, src, tmp_path / "hf" / name, steps, pp))
    # the same run resumed for one more step: its export replaces the earlier one, whole
    log_dir, trained = tmp_path / "llama-z0-trained", tmp_path / "hf" / "llama-z0-trained"
    cases.append(
        _case(
            "llama-z0-trained-more",
            "llama-tiny",
            0,
            tmp_path / "in-llama-tiny",
            trained,
            2,
            2,
            f"log.dir={log_dir}",
        )
    )
    rows = run_cases(tmp_path, 2, cases)
    assert rows["llama-z0"] == [] and len(rows["llama-z0-trained"]) == 1
    assert [r["step"] for r in rows["llama-z0-trained-more"]] == [2]
    for name, preset, _, steps, _ in plan:
        _check_export(tmp_path / "hf" / name, models[preset], TOKENS, steps)
    _check_replaced(log_dir, str(trained), [name for name, *_ in plan])


def _check_replaced(log_dir, export: str, exports: list[str]) -> None:
    """The run's closing line names the directory; the export there is step 2's, of this run,
    and nothing of the swap is left beside it."""
    from dsnd.model.export_dir import read_marker

    said = last_log_text(str(log_dir), 0, "exported step ")
    assert re.fullmatch(
        rf"2 as a transformers directory \(\d+ tensors\) to {re.escape(export)} "
        r"\(replacing the export of step 1 there\)",
        said,
    ), said
    marker = read_marker(export)
    assert (marker["checkpoint_root"], marker["step"]) == (f"{log_dir}/checkpoints", 2), marker
    assert sorted(os.listdir(os.path.dirname(export))) == sorted(exports)


@pytest.mark.dist
def test_hf_roundtrip_tensor_parallel_and_init_independent_of_tp(tmp_path):
    """tp=2 x pp=2 (4 ranks): HF weights in and out for Llama (grouped-query attention) and GPT-2
    (fused q|k|v, tied head), with and without sequence parallelism; and dsnd's own
    initialisation exported from tp=2 x pp=2 and from pp=2 x dp=2 is the same model, bit for
    bit, for both families, also after one training step (within 1e-5). The MoE families
    (attention split, experts whole on each tensor-parallel rank; per-expert tensors in the
    files) in and out at tp=2 x pp=2 and at tp=2 x dp=2 with the experts over ep=2."""
    models, cases = {}, []
    for preset in ("llama-tiny", "gpt2-tiny", "mixtral-tiny", "qwen3-moe-tiny"):
        models[preset] = _hf_model(preset)
        models[preset].save_pretrained(tmp_path / f"in-{preset}")
    tp2 = ("parallel.tp=2",)
    sp = (*tp2, "parallel.sequence_parallel=true")
    plan = [  # name, preset, ZeRO stage, extra sets, pp
        ("llama-tp2-z0", "llama-tiny", 0, tp2, 2),
        ("llama-tp2-sp-z3", "llama-tiny", 3, sp, 2),
        ("gpt2-tp2-z3", "gpt2-tiny", 3, tp2, 2),
        ("gpt2-tp2-sp-z1", "gpt2-tiny", 1, sp, 2),
        ("mixtral-tp2-z3", "mixtral-tiny", 3, tp2, 2),
        ("qwen3moe-tp2-sp-ep2-z1", "qwen3-moe-tiny", 1, (*sp, "parallel.ep=2"), 1),
    ]
    for name, preset, zero, extra, pp in plan:
        src = tmp_path / f"in-{preset}"
        cases.append(_case(name, preset, zero, src, tmp_path / "hf" / name, 0, pp, *extra))
    for preset in ("llama-tiny", "gpt2-tiny"):
        for steps in (0, 1):
            for layout, extra in (("tp1", ()), ("tp2", tp2)):
                name = f"own-{preset}-{steps}-{layout}"
                cases.append(_case(name, preset, 3, None, tmp_path / "hf" / name, steps, 2, *extra))
    run_cases(tmp_path, 4, cases)
    for name, preset, *_ in plan:
        _check_export(tmp_path / "hf" / name, models[preset], TOKENS, 0)
    for preset in ("llama-tiny", "gpt2-tiny"):
        for steps in (0, 1):
            one, two = (
                load_file(tmp_path / "hf" / f"own-{preset}-{steps}-{t}" / "model.safetensors")
                for t in ("tp1", "tp2")
            )
            assert sorted(one) == sorted(two), preset
            for key in one:
                if steps == 0:
                    assert torch.equal(one[key], two[key]), (preset, key)
                else:
                    torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-5)


def test_init_from_refuses_a_checkpoint_of_another_model(tmp_path):
    gpt2 = spec_of("gpt2-tiny")
    write_hf_dir(str(tmp_path), gpt2, build_model(gpt2, seed=0).state_dict())
    check_init_from(str(tmp_path), gpt2)
    with pytest.raises(
        UserError,
        match=r"config.json activation_function='gelu_new' but the "
        r"run's model \(preset llama-tiny\) has None",
    ):
        check_init_from(str(tmp_path), spec_of("llama-tiny"))
    wider = spec_of("gpt2-tiny", hidden_size=128)
    with pytest.raises(UserError, match=r"config.json n_embd=64 but .* has 128"):
        check_init_from(str(tmp_path), wider)
