"""Chat data counts only the assistant's tokens: data where nothing counts is refused before
start (it trained at loss 0.0000, grad norm 0, and committed checkpoints), and the share that
counts is said at start (issue 37)."""

from __future__ import annotations

import numpy as np
import pytest

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data.batch_extras import sample_sets
from dsnd.data.check import check_data
from dsnd.data.corpus import Corpus
from dsnd.data.counted import counted_line
from dsnd.data.sources import load_data
from dsnd.errors import UserError
from tests.chat_data import chat_jsonl, conversations, word_tokenizer


def test_chat_data_without_an_assistant_turn_is_refused(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    users_only = [[m for m in c if m["role"] == "user"] for c in conversations()]
    path = chat_jsonl(tmp_path / "chat.jsonl", users_only)
    data, model = DataConfig(path=path, format="chat"), ModelConfig(init_from=tok, seq_len=16)
    tokens = len(load_data(data, model).tokens)
    with pytest.raises(UserError) as e:
        check_data(data, 256, model)
    assert str(e.value) == (
        f"data.path={path}: none of its {tokens:,} tokens counts in the loss "
        "(chat data: no conversation has an assistant turn); training on it "
        "would change nothing"
    )


def test_counted_tokens_that_are_no_samples_label_are_refused():
    """Every counted token is the first of its sample (never a label) or past the last whole
    sample: no label of any sample counts."""
    tokens = np.arange(50, dtype=np.uint16)
    targets = np.zeros(50, dtype=bool)
    targets[[0, 11, 22, 33, 48]] = True  # samples of 11 tokens: 0, 11, 22, 33 start one
    corpus = Corpus(tokens, "t.bin", "x", targets=targets)
    samples, _ = sample_sets(corpus, 10, "stream")
    with pytest.raises(UserError) as e:
        counted_line(corpus, samples, "stream")
    assert str(e.value) == (
        "data.path=t.bin: none of its 5 counted tokens is the label of a "
        "training sample (4 samples of model.seq_len 10 + 1 tokens, "
        "data.packing=stream: a sample's first token, the tokens after the "
        "last whole sample and a document's first token are no labels); "
        "training on it would change nothing"
    )
    targets[12] = True  # one label that counts is enough
    assert counted_line(corpus, samples, "stream") == (
        "data: 6 of 50 tokens counted in the loss (12.0%)"
    )


def test_the_share_of_chat_data_that_counts_is_said(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    corpus = load_data(
        DataConfig(path=chat_jsonl(tmp_path / "chat.jsonl"), format="chat"),
        ModelConfig(init_from=tok),
    )
    counted, total = int(corpus.targets.sum()), len(corpus.tokens)
    assert 0 < counted < total
    samples, _ = sample_sets(corpus, 16, "documents")
    assert counted_line(corpus, samples, "documents") == (
        f"data: {counted:,} of {total:,} tokens counted in the loss ({100 * counted / total:.1f}%)"
    )
    plain = Corpus(corpus.tokens, "p", "x")  # no targets: every token counts, nothing said
    assert counted_line(plain, sample_sets(plain, 16, "stream")[0], "stream") is None


def test_a_token_files_share_comes_from_its_sidecar_without_reading_the_mask(tmp_path, monkeypatch):
    """`dsnd data prepare` records how many tokens its mask counts; a run takes that number (a
    mask of any size is not read at start), and a sidecar's count that cannot be is refused."""
    import json

    from dsnd.data import counted as counted_module
    from dsnd.data.corpus import token_corpus
    from dsnd.data.token_writer import TokenWriter

    path = str(tmp_path / "chat.bin")
    writer = TokenWriter(path, np.dtype(np.uint16), targets=True)
    for lo in range(0, 200, 20):
        writer.begin_document()
        writer.add(np.arange(lo, lo + 20) % 256, (np.arange(20) >= 12).astype(np.uint8))
    meta = writer.finish(256, "byte", "t", None)
    assert meta["counted"] == 80
    monkeypatch.setattr(counted_module, "READ_AT_START", 10)  # as if the mask were huge
    corpus = token_corpus(path)
    samples, _ = sample_sets(corpus, 9, "stream")
    assert counted_line(corpus, samples, "stream") == (
        "data: 80 of 200 tokens counted in the loss (40.0%)"
    )
    meta["counted"] = 201
    (tmp_path / "chat.bin.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as e:
        token_corpus(path)
    assert str(e.value) == (
        f"{path}.json: counted must be an integer from 0 to its 200 tokens, got 201"
    )


def test_the_full_check_compares_the_recorded_count_with_the_mask(tmp_path):
    import json

    from dsnd.data.token_writer import TokenWriter
    from dsnd.data.verify import verify_token_file

    path = str(tmp_path / "m.bin")
    writer = TokenWriter(path, np.dtype(np.uint16), targets=True)
    writer.begin_document()
    writer.add(np.arange(30), (np.arange(30) % 3 == 0).astype(np.uint8))
    meta = writer.finish(256, "byte", "t", None)
    assert verify_token_file(path)["counted"] == 10
    meta["counted"] = 11
    (tmp_path / "m.bin.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as e:
        verify_token_file(path)
    assert str(e.value) == f"{path}.mask: counts 10 tokens, {path}.json records counted 11"
