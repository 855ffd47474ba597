"""Data pipeline: layout-independent sample order, corpus loading, byte tokenizer."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dsnd.data import (
    ByteTokenizer,
    SampleSet,
    batch_for_step,
    global_batch_indices,
    load_corpus,
    micro_batches,
)
from dsnd.errors import UserError

SEQ = 8
GLOBAL = 16
LAYOUTS = [(1, 16), (2, 2), (4, 1), (2, 8)]


@pytest.fixture(scope="module")
def samples() -> SampleSet:
    # 40 samples whose every token is unique per sample, so a sample is recognisable by value.
    tokens = np.arange(40 * (SEQ + 1), dtype=np.int64)
    return SampleSet(tokens, SEQ)


def _rows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, ...]]:
    """Each sample of a list of micro-batches as a hashable row (x then y), in order."""
    rows = []
    for x, y in batches:
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape and x.shape[1] == SEQ
        rows += [tuple(r) for r in torch.cat([x, y], dim=1).tolist()]
    return rows


def _all_ranks(samples: SampleSet, dp: int, micro: int, seed: int, step: int) -> list:
    rows = []
    for rank in range(dp):
        rows += _rows(batch_for_step(samples, seed, step, GLOBAL, rank, dp, micro))
    return rows


@pytest.mark.parametrize("step", [0, 1, 2, 7])
def test_layout_independence(samples: SampleSet, step: int) -> None:
    reference = _all_ranks(samples, 1, GLOBAL, seed=3, step=step)
    assert len(reference) == GLOBAL
    for dp, micro in LAYOUTS:
        got = _all_ranks(samples, dp, micro, seed=3, step=step)
        assert Counter(got) == Counter(reference), (dp, micro)
        assert got == reference, (dp, micro)  # rank-by-rank concatenation is the global order


def test_micro_batch_shapes(samples: SampleSet) -> None:
    batches = batch_for_step(samples, 0, 0, GLOBAL, dp_rank=1, dp=2, micro=2)
    assert len(batches) == 4
    assert all(x.shape == (2, SEQ) and y.shape == (2, SEQ) for x, y in batches)
    x, y = batches[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token


def test_steps_and_seeds_differ() -> None:
    a = global_batch_indices(1000, 16, seed=0, step=0)
    assert not np.array_equal(a, global_batch_indices(1000, 16, seed=0, step=1))
    assert not np.array_equal(a, global_batch_indices(1000, 16, seed=1, step=0))
    assert np.array_equal(a, global_batch_indices(1000, 16, seed=0, step=0))


@pytest.mark.parametrize("num, batch", [(10, 4), (10, 3), (7, 7), (10, 25), (3, 1)])
def test_epoch_crossing_covers_each_sample_once(num: int, batch: int) -> None:
    epochs = 4
    steps = -(-epochs * num // batch)
    stream = np.concatenate([global_batch_indices(num, batch, 5, s) for s in range(steps)])
    assert all(len(global_batch_indices(num, batch, 5, s)) == batch for s in range(steps))
    for e in range(epochs):
        assert sorted(stream[e * num : (e + 1) * num].tolist()) == list(range(num))
    first, second = stream[:num], stream[num : 2 * num]
    assert num < 5 or not np.array_equal(first, second)  # epochs are reshuffled


def test_sample_set_windows_and_errors() -> None:
    tokens = np.arange(30, dtype=np.uint8)
    s = SampleSet(tokens, seq_len=4)
    assert len(s) == 6  # 30 // 5, non-overlapping
    x, y = s.sample(1)
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        s.sample(6)
    with pytest.raises(UserError, match=r"3 tokens.*5 \(seq_len 4 \+ 1\)"):
        SampleSet(np.zeros(3, dtype=np.uint8), seq_len=4)


def test_micro_batches_rejects_uneven_splits(samples: SampleSet) -> None:
    idx = global_batch_indices(len(samples), 12, 0, 0)
    with pytest.raises(ValueError, match="not divisible by dp 5"):
        micro_batches(samples, idx, 0, 5, 1)
    with pytest.raises(ValueError, match="micro-batch size 4"):
        micro_batches(samples, idx, 0, 2, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        micro_batches(samples, idx, 2, 2, 1)


def test_jsonl_loads_and_joins(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "héllo"}\n\n{"text": "world", "id": 2}\n', encoding="utf-8")
    c = load_corpus(str(p))
    assert c.tokens.tobytes().decode() == "héllo\n\nworld"
    assert c.tokens.dtype == np.uint8 and c.name == str(p)
    custom = tmp_path / "d.json"
    custom.write_text(json.dumps({"body": "abc"}) + "\n")
    assert load_corpus(str(custom), text_field="body").tokens.tobytes() == b"abc"


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("not json", r"d\.jsonl:2: not valid JSON.*'text'"),
        ("[1, 2]", r"d\.jsonl:2: expected a JSON object with field 'text'"),
        ('{"content": "x"}', r"d\.jsonl:2: record has no field 'text' \(fields: content\)"),
        ('{"text": 5}', r"d\.jsonl:2: field 'text' must be a string"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path: Path, line: str, pattern: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(UserError, match=pattern):
        load_corpus(str(p))


def test_text_file_missing_file_and_bad_format(tmp_path: Path) -> None:
    p = tmp_path / "notes.md"
    p.write_bytes(b"abcdef\xff")
    assert load_corpus(str(p)).tokens.tobytes() == b"abcdef\xff"
    assert load_corpus(str(p), max_bytes=3).tokens.tobytes() == b"abc"
    with pytest.raises(UserError, match=r"data\.path: file not found: .*nope\.txt"):
        load_corpus(str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="unknown corpus format 'csv'"):
        load_corpus(str(p), fmt="csv")


def test_stdlib_corpus_deterministic_and_bounded() -> None:
    t0 = time.perf_counter()
    a = load_corpus(None)
    elapsed = time.perf_counter() - t0
    b = load_corpus(None)
    assert 0 < len(a.tokens) <= 4_000_000
    assert a.fingerprint == b.fingerprint and np.array_equal(a.tokens, b.tokens)
    assert a.name.startswith("python") and a.name.endswith("-stdlib")
    assert elapsed < 1.0
    small = load_corpus(None, max_bytes=1000)
    assert len(small.tokens) == 1000
    assert np.array_equal(small.tokens, a.tokens[:1000])  # same file order, just cut shorter


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and ids.dtype == np.uint8
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # cut mid-character: replaced, not raised
