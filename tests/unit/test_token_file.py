"""Pre-tokenized corpora: `dsnd data prepare` writes a token file that loads as the same tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dsnd import cli
from dsnd.data.corpus import load_corpus
from dsnd.errors import UserError

DOCS = [
    {"text": f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs."} for i in range(50)
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS))
    return path


def test_byte_token_file_loads_as_the_same_tokens(tmp_path, jsonl, capsys):
    out = tmp_path / "train.bin"
    assert cli.main(["data", "prepare", str(jsonl), str(out)]) == 0
    assert "tokens (uint16, vocabulary 256)" in capsys.readouterr().out
    meta = json.loads((tmp_path / "train.bin.json").read_text())
    direct = load_corpus(str(jsonl))
    assert meta["tokens"] == len(direct.tokens) and meta["tokenizer"] == "byte"
    from_file = load_corpus(str(out))  # auto: .bin -> tokens
    assert isinstance(from_file.tokens, np.memmap) and from_file.vocab_size == 256
    assert np.array_equal(from_file.tokens, direct.tokens)
    capped = load_corpus(str(out), max_bytes=100)  # bytes of the file: 50 uint16 tokens
    assert np.array_equal(capped.tokens, direct.tokens[:50])


def test_transformers_tokenizer_from_a_local_directory(tmp_path, jsonl):
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        [d["text"] for d in DOCS], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    fast.save_pretrained(tmp_path / "tok")
    out = tmp_path / "words.bin"
    assert (
        cli.main(["data", "prepare", str(jsonl), str(out), "--tokenizer", str(tmp_path / "tok")])
        == 0
    )
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = load_corpus(str(jsonl)).tokens.tobytes().decode()
    corpus = load_corpus(str(out))
    assert corpus.tokens.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert corpus.vocab_size == len(tok)


def test_bad_token_files_are_user_errors(tmp_path, jsonl):
    out = tmp_path / "t.bin"
    assert cli.main(["data", "prepare", str(jsonl), str(out)]) == 0
    with open(out, "ab") as f:
        f.write(b"\x00")  # half a uint16
    with pytest.raises(UserError, match="not a whole number of uint16 tokens"):
        load_corpus(str(out))
    (tmp_path / "t.bin.json").unlink()
    with pytest.raises(UserError, match=r"t\.bin\.json: cannot read the token file's metadata"):
        load_corpus(str(out))
