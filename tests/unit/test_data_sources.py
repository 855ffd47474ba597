"""The data users have (issue 26 items 13 and 15): Hugging Face datasets saved to disk, text
tokenized with the model's own tokenizer, chat JSONL with an assistant-only loss mask, document
packing, and the tokenizer of model.init_from's pretrained weights checked against the data's.
Datasets and tokenizers are built here; nothing is downloaded."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data import batch_for_step
from dsnd.data.batch_extras import batch_extras, sample_sets
from dsnd.data.check import check_data
from dsnd.data.sampler import global_batch_indices
from dsnd.data.sources import load_data
from dsnd.errors import UserError
from tests.chat_data import (
    MARKED_TEMPLATE,
    PLAIN_TEMPLATE,
    TEXTS,
    chat_jsonl,
    conversations,
    word_tokenizer,
)

datasets = pytest.importorskip("datasets")


@pytest.fixture
def tok_dir(tmp_path):
    return word_tokenizer(tmp_path / "tok")


def _encoded(tok_dir: str, texts: list[str]) -> list[int]:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [1]]


# --- Hugging Face datasets, tokenized with the model's tokenizer -------------------------------


@pytest.mark.parametrize("kind", ["save_to_disk", "dataset_dict", "parquet", "arrow"])
def test_a_hugging_face_dataset_is_tokenized_with_the_models_tokenizer(tmp_path, tok_dir, kind):
    ds = datasets.Dataset.from_dict({"body": TEXTS, "n": list(range(len(TEXTS)))})
    path = tmp_path / "ds"
    if kind == "save_to_disk":
        ds.save_to_disk(path)
    elif kind == "dataset_dict":
        datasets.DatasetDict({"train": ds.select(range(3)), "valid": ds}).save_to_disk(path)
    elif kind == "parquet":
        path = tmp_path / "ds.parquet"
        ds.to_parquet(path)
    else:
        ds.save_to_disk(path)
        path = next(path.glob("*.arrow"))
    data = DataConfig(path=str(path), text_field="body", split="valid")
    corpus = load_data(data, ModelConfig(init_from=tok_dir))  # no data.vocab: the model's
    assert corpus.tokens.tolist() == _encoded(tok_dir, TEXTS)  # each document closed by EOS
    sizes = [len(_encoded(tok_dir, [t])) for t in TEXTS]
    assert corpus.documents.tolist() == np.repeat(np.arange(len(TEXTS)), sizes).tolist()
    assert corpus.tokenizer == tok_dir
    assert corpus.vocab_size == len(AutoTokenizer.from_pretrained(tok_dir))
    check_data(data, 256, ModelConfig(init_from=tok_dir))


def test_dataset_errors_are_one_line(tmp_path, tok_dir, monkeypatch):
    ds = datasets.Dataset.from_dict({"body": TEXTS})
    ds.save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"valid": ds}).save_to_disk(tmp_path / "dd")
    model = ModelConfig(init_from=tok_dir)
    path = str(tmp_path / "ds")
    with pytest.raises(UserError) as e:
        load_data(DataConfig(path=path), model)
    assert str(e.value) == (
        f"data.path={path}: the dataset has no column 'text' (columns: body); set data.text_field"
    )
    with pytest.raises(UserError, match=r"no split 'train' in the DatasetDict \(splits: valid\)"):
        load_data(DataConfig(path=str(tmp_path / "dd"), text_field="body"), model)
    with pytest.raises(UserError, match="neither model.init_from nor model.config names a dir"):
        load_data(DataConfig(path=path, text_field="body"), ModelConfig())
    monkeypatch.setitem(sys.modules, "datasets", None)  # as where the package is not installed
    with pytest.raises(UserError) as e:
        load_data(DataConfig(path=path, text_field="body"), model)
    assert str(e.value) == (
        f"data.path={path} is a Hugging Face dataset, which needs the "
        "datasets package: pip install 'dsnd[data]' (or: pip install "
        "datasets)"
    )


def test_jsonl_tokenized_with_the_model_tokenizer_on_request(tmp_path, tok_dir):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    model = ModelConfig(init_from=tok_dir)
    corpus = load_data(DataConfig(path=str(path), vocab="model"), model)
    assert corpus.tokens.tolist() == _encoded(tok_dir, TEXTS)
    byte = load_data(DataConfig(path=str(path)), ModelConfig(init_from=tok_dir))
    assert byte.tokenizer == "byte" and byte.tokens.dtype == np.uint8  # as before: bytes
    assert byte.documents[: len(TEXTS[0]) + 2].tolist() == [0] * (len(TEXTS[0]) + 2)
    assert byte.documents[len(TEXTS[0]) + 2] == 1  # the blank line belongs to the document


# --- item 13: the pretrained weights' tokenizer against the data's -------------------------------


def test_byte_data_for_a_model_with_its_own_tokenizer_is_refused(tmp_path, tok_dir):
    model = ModelConfig(init_from=tok_dir)
    with pytest.raises(UserError) as e:
        check_data(DataConfig(), 256, model)
    assert str(e.value) == (
        "data.path=null (the Python standard library's sources): the data is tokenized with "
        f"byte tokens, but model.init_from={tok_dir} has its own tokenizer; set data.vocab: "
        "model to tokenize the data with it, or data.allow_vocab_mismatch: true to train on "
        "it as is"
    )
    check_data(DataConfig(allow_vocab_mismatch=True, max_bytes=10_000), 256, model)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(TEXTS))
    check_data(DataConfig(path=str(text), vocab="model"), 256, model)
    other = word_tokenizer(tmp_path / "other")  # a copy of the same vocabulary: the same ids
    check_data(DataConfig(path=str(text), vocab=other), 256, model)
    check_data(DataConfig(), 256, ModelConfig())  # no pretrained tokenizer: bytes as ever


def test_token_files_name_their_tokenizer(tmp_path, tok_dir):
    from dsnd import cli

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    mine, byte = tmp_path / "mine.bin", tmp_path / "byte.bin"
    assert cli.main(["data", "prepare", str(src), str(mine), "--tokenizer", tok_dir]) == 0
    assert cli.main(["data", "prepare", str(src), str(byte)]) == 0
    model = ModelConfig(init_from=tok_dir)
    check_data(DataConfig(path=str(mine)), 256, model)
    with pytest.raises(UserError) as e:
        check_data(DataConfig(path=str(byte)), 256, model)
    assert str(e.value).startswith(
        f"data.path={byte}: {byte}.json names byte tokens, but "
        f"model.init_from={tok_dir} has its own tokenizer"
    )


# --- chat: the chat template, loss on the assistant's tokens only --------------------------------


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, MARKED_TEMPLATE])
def test_chat_counts_only_assistant_tokens(tmp_path, template):
    tok_dir = word_tokenizer(tmp_path / "tok", template)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    path = chat_jsonl(tmp_path / "chat.jsonl")
    corpus = load_data(DataConfig(path=path, format="chat"), ModelConfig(init_from=tok_dir))
    first = conversations(1)[0]
    ids = tok.apply_chat_template(first, tokenize=True, return_dict=True)["input_ids"]
    n = len(ids)
    assert corpus.tokens[:n].tolist() == ids and corpus.documents[n] == 1
    counted = [
        tok.convert_ids_to_tokens(int(i)) for i, t in zip(ids, corpus.targets[:n], strict=True) if t
    ]
    # the assistant's content and end-of-turn; not its header, not the user's turns
    assert counted == ["the", "quick", "brown", "fox", "0", "<|end|>", "lazy", "dogs", "<|end|>"]


def test_chat_refusals(tmp_path):
    no_template = word_tokenizer(tmp_path / "plain", template=None)
    path = chat_jsonl(tmp_path / "chat.jsonl")
    with pytest.raises(UserError) as e:
        load_data(DataConfig(path=path, format="chat"), ModelConfig(init_from=no_template))
    assert str(e.value) == (
        f"data.format=chat: the tokenizer {no_template} has no chat template "
        "(tokenizer_config.json chat_template or chat_template.jinja)"
    )
    tok_dir = word_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": conversations(1)[0]})
        + "\n"
        + json.dumps({"messages": [{"role": "user"}]})
        + "\n"
    )
    with pytest.raises(UserError, match=rf"^{bad}:2: message 0 must have string role and content"):
        load_data(DataConfig(path=str(bad), format="chat"), ModelConfig(init_from=tok_dir))
    # a template that drops earlier turns: a prefix renders as other tokens
    dropping = word_tokenizer(tmp_path / "drop", "{{ messages[-1]['content'] }}")
    with pytest.raises(UserError, match=r"chat.jsonl:1: the chat template renders the first 1 "):
        load_data(DataConfig(path=path, format="chat"), ModelConfig(init_from=dropping))


# --- document packing: labels, positions and the mask -------------------------------------------


def test_packing_keeps_documents_apart_in_labels(tmp_path, tok_dir):
    path = chat_jsonl(tmp_path / "chat.jsonl")
    corpus = load_data(DataConfig(path=path, format="chat"), ModelConfig(init_from=tok_dir))
    samples, _ = sample_sets(corpus, 16, "documents")
    stream, _ = sample_sets(corpus, 16, "stream")
    x, y = samples.batch(np.arange(len(samples)))
    docs = samples.document_ids(np.arange(len(samples)))
    targets = torch.from_numpy(corpus.targets[: len(samples) * 17].reshape(-1, 17)[:, 1:])
    window = torch.from_numpy(corpus.documents[: len(samples) * 17].reshape(-1, 17).astype(int))
    crossing = window[:, 1:] != window[:, :-1]
    assert ((y == -100) == (~targets | crossing)).all() and crossing.any()
    assert torch.equal(docs, window[:, :-1])
    _, y_stream = stream.batch(np.arange(len(stream)))
    assert ((y_stream == -100) == ~targets).all()  # stream packing: the next document counts


def test_loss_weights_give_the_global_mean_on_every_layout(tmp_path, tok_dir):
    path = chat_jsonl(tmp_path / "chat.jsonl")
    corpus = load_data(DataConfig(path=path, format="chat"), ModelConfig(init_from=tok_dir))
    samples, _ = sample_sets(corpus, 8, "documents")
    torch.manual_seed(0)
    losses = torch.rand(len(samples), 8, dtype=torch.float64)  # a loss per token of each sample
    for step in range(3):
        indices = global_batch_indices(len(samples), 8, 0, step)
        _, y = samples.batch(indices)
        want = (losses[indices][y != -100].sum() / (y != -100).sum()).item()
        for dp, micro in ((1, 8), (1, 1), (2, 2), (4, 1), (8, 1)):
            got = 0.0  # dsnd's: weighted micro-batch means, averaged over micro-batches and ranks
            for rank in range(dp):
                where = (0, step, 8, rank, dp, micro)
                weights = batch_extras(samples, *where).weights
                mine = indices[rank * 8 // dp : (rank + 1) * 8 // dp]
                for k, ((_, y_m), w) in enumerate(
                    zip(batch_for_step(samples, *where), weights, strict=True)
                ):
                    rows = mine[k * micro : (k + 1) * micro]
                    mean = losses[rows][y_m != -100].mean().item() if w else 0.0
                    got += w * mean / (len(weights) * dp)
            assert got == pytest.approx(want, rel=1e-12), (step, dp, micro)


def test_unmasked_data_keeps_the_plain_mean():
    from dsnd.data.corpus import load_corpus

    samples, _ = sample_sets(load_corpus(None, max_bytes=20_000), 16, "stream")
    assert batch_extras(samples, 0, 0, 8, 0, 2, 2) is None  # the executor's path of before


def test_packing_needs_document_boundaries(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one long text " * 100)
    for path, name in ((None, "null (the Python standard library)"), (str(text), str(text))):
        with pytest.raises(UserError) as e:
            check_data(DataConfig(path=path, packing="documents", max_bytes=10_000), 256)
        assert str(e.value) == (
            f"data.packing=documents: data.path={name} records no document "
            "boundaries; use JSONL, a Hugging Face dataset, chat data or a "
            "token file prepared with its documents"
        )


def test_dsnd_train_refuses_before_start(capsys, tmp_path, monkeypatch):
    from tests.unit.test_bring_your_model import sets, user_dir
    from tests.unit.test_prestart import isolated, refused

    isolated.__wrapped__(monkeypatch, tmp_path)
    pretrained = user_dir(tmp_path / "pretrained")
    word_tokenizer(tmp_path / "pretrained")  # the tokenizer the weights were trained with
    capsys.readouterr()
    assert refused(capsys, "train", *sets(f"model.init_from={pretrained}")) == (
        "data.path=null (the Python standard library's sources): the data is tokenized with "
        f"byte tokens, but model.init_from={pretrained} has its own tokenizer; set data.vocab: "
        "model to tokenize the data with it, or data.allow_vocab_mismatch: true to train on it "
        "as is"
    )
