"""An export carries every file its model directory's tokenizer was saved in — the chat
template of transformers 5 (chat_template.jinja) too — so a chat fine-tune from one's own
export is accepted (issue 37)."""

from __future__ import annotations

import os

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data.check import check_data
from dsnd.model import build_model
from dsnd.model.export_dir import ExportOrigin
from dsnd.model.hf_io import write_hf_dir
from dsnd.model.source import load_model, tokenizer_files
from tests.chat_data import chat_jsonl, word_tokenizer
from tests.unit.test_bring_your_model import user_dir


def test_a_chat_fine_tune_from_an_export_keeps_its_chat_template(tmp_path):
    model_dir = user_dir(tmp_path / "model")
    word_tokenizer(tmp_path / "model")  # saved beside the weights, as a published model is
    (tmp_path / "model" / "additional_chat_templates").mkdir()
    (tmp_path / "model" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    assert (tmp_path / "model" / "chat_template.jinja").is_file()  # transformers 5's place
    spec = load_model(model_dir, "model.init_from")
    export = str(tmp_path / "export")
    write_hf_dir(
        export, spec, build_model(spec, seed=0).state_dict(), spec.directory, ExportOrigin(None, 3)
    )
    carried = tokenizer_files(model_dir)
    assert {
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "additional_chat_templates/tool_use.jinja",
    } <= set(carried)
    assert not {"config.json", "model.safetensors"} & set(carried)  # the export writes its own
    for name in carried:
        with (
            open(os.path.join(model_dir, name), "rb") as a,
            open(os.path.join(export, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    chat = chat_jsonl(tmp_path / "chat.jsonl")
    check_data(
        DataConfig(path=chat, format="chat"),
        spec.vocab_size,
        ModelConfig(init_from=export, seq_len=32),
    )
