"""Inputs that used to end in a traceback deep in transformers or a rank, refused in one line
before anything starts (issue 37)."""

from __future__ import annotations

import json

import pytest

from dsnd.errors import UserError
from dsnd.model.source import PRESET_DIR, load_model


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen1.5-moe-a2.7b"])
def test_a_decoder_sparse_step_of_0_is_refused_by_name(tmp_path, preset):
    """Qwen-MoE's layer i is sparse when (i + 1) % decoder_sparse_step == 0: 0 was a
    ZeroDivisionError while building the layers (plan, train, model show alike)."""
    with open(f"{PRESET_DIR}/{preset}.json", encoding="utf-8") as f:
        raw = json.load(f)
    raw["decoder_sparse_step"] = 0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError) as e:
        load_model(str(tmp_path), "model.config")
    assert str(e.value) == (
        f"{tmp_path}/config.json: decoder_sparse_step=0: must be an integer "
        ">= 1 (layer i is a mixture of experts when (i + 1) % "
        "decoder_sparse_step == 0; 1 = every layer)"
    )
