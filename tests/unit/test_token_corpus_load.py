"""Data of real size: no silent cap, token files mapped with their document starts and loss mask
and checked without reading their tokens, and a sample order that never tables every sample."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from dsnd.config.load import default_config_path
from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data import batch_for_step
from dsnd.data.batch_extras import batch_extras, sample_sets
from dsnd.data.check import check_data
from dsnd.data.corpus import STDLIB_BYTES, Corpus, load_corpus
from dsnd.data.sampler import IGNORE_INDEX, global_batch_indices
from dsnd.data.shuffle import TABLE_SAMPLES, epoch_samples, feistel
from dsnd.data.sources import load_data
from dsnd.data.verify import verify_token_file
from dsnd.errors import UserError


def write_tokens(path: Path, ids, vocab: int = 256, starts=None, mask=None, **meta) -> str:
    """A token file as `dsnd data prepare` writes it (the format, written directly)."""
    ids = np.asarray(ids, dtype="<u2")
    ids.tofile(path)
    sidecar = {
        "dtype": "uint16",
        "vocab_size": vocab,
        "tokens": len(ids),
        "tokenizer": "byte",
        "source": "test",
        "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
        "eot": None,
    }
    if starts is not None:
        np.asarray(starts, dtype="<i8").tofile(f"{path}.docs")
        sidecar["documents"] = len(starts)
    if mask is not None:
        np.asarray(mask, dtype="u1").tofile(f"{path}.mask")
        sidecar["targets"] = True
    sidecar.update(meta)
    Path(f"{path}.json").write_text(json.dumps(sidecar))
    return str(path)


def _error(call, *args) -> str:
    with pytest.raises(UserError) as e:
        call(*args)
    return str(e.value)


def test_no_silent_cap_and_a_cap_said_in_one_line(tmp_path):
    default = yaml.safe_load(Path(default_config_path()).read_text())
    assert DataConfig().max_bytes is None and default["data"]["max_bytes"] is None
    text = tmp_path / "big.txt"
    text.write_bytes(bytes(range(32, 127)) * 50_000)  # 4.75 MB: past the old 4 MB default
    corpus = load_data(DataConfig(path=str(text)), ModelConfig())
    assert len(corpus.tokens) == 4_750_000 and corpus.notes == ()
    capped = load_data(DataConfig(path=str(text), max_bytes=1_000_000), ModelConfig())
    assert len(capped.tokens) == 1_000_000
    assert capped.notes == (
        f"data: data.max_bytes=1000000 reads the first 1000000 of 4750000 bytes (21.1%) of {text}",
    )
    tokens = write_tokens(tmp_path / "t.bin", np.arange(2_500_000) % 256)  # 5 MB of uint16
    assert len(load_data(DataConfig(path=tokens), ModelConfig()).tokens) == 2_500_000
    capped = load_data(DataConfig(path=tokens, max_bytes=1000), ModelConfig())
    assert len(capped.tokens) == 500 and capped.notes == (
        f"data: data.max_bytes=1000 reads the first 1000 of 5000000 bytes (0.0%) of {tokens}",
    )
    # the default corpus keeps its own size, whatever data.max_bytes is
    assert len(load_corpus(None).tokens) == STDLIB_BYTES
    assert len(load_corpus(None, max_bytes=10**9).tokens) == STDLIB_BYTES


def test_token_file_start_takes_the_sidecars_fingerprint_without_reading_tokens(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(3000) % 256)
    recorded = "ab" * 32
    meta = json.loads(Path(path + ".json").read_text())
    Path(path + ".json").write_text(json.dumps({**meta, "sha256": recorded}))
    check_data(DataConfig(path=path), 256)  # nothing at start reads every token
    assert load_corpus(path).fingerprint == recorded
    assert _error(verify_token_file, path).startswith(f"{path}: SHA-256 ")  # the explicit check


def test_document_starts_and_mask_of_a_token_file(tmp_path):
    rng = np.random.default_rng(0)
    ids, mask = rng.integers(0, 256, 2000), rng.random(2000) < 0.7
    starts = np.array([0, 5, 300, 301, 1234, 1990])
    path = write_tokens(tmp_path / "t.bin", ids, starts=starts, mask=mask)
    check_data(DataConfig(path=path, packing="documents"), 256, ModelConfig(seq_len=16))
    corpus = load_data(DataConfig(path=path, packing="documents"), ModelConfig())
    per_token = np.repeat(np.arange(len(starts)), np.diff([*starts, 2000]))
    train, held = sample_sets(corpus, 16, "documents", 0.25)
    for samples, first in ((train, 0), (held, len(train))):
        rows = np.arange(len(samples))
        x, y = samples.batch(rows)
        window = per_token[first * 17 : (first + len(samples)) * 17].reshape(-1, 17)
        counted = mask[first * 17 : (first + len(samples)) * 17].reshape(-1, 17)[:, 1:]
        crossing = window[:, 1:] != window[:, :-1]
        assert np.array_equal(samples.document_ids(rows).numpy(), window[:, :-1])
        assert np.array_equal((y == IGNORE_INDEX).numpy(), ~counted | crossing)
        tokens = ids[first * 17 : (first + len(samples)) * 17].reshape(-1, 17)
        assert np.array_equal(x.numpy(), tokens[:, :-1])
    layout = batch_extras(train, 0, 1, 8, 1, 2, 2)
    assert len(layout.weights) == 2 and layout.documents[0].shape == (2, 16)


def _mutate(path: str, what: str) -> None:
    meta = json.loads(Path(path + ".json").read_text())
    changes = {
        "docs-missing": lambda: Path(path + ".docs").unlink(),
        "docs-size": lambda: Path(path + ".docs").write_bytes(b"\0" * 20),
        "docs-first": lambda: np.array([3, 50, 90], "<i8").tofile(path + ".docs"),
        "docs-last": lambda: np.array([0, 50, 100], "<i8").tofile(path + ".docs"),
        "docs-order": lambda: np.array([0, 50, 50], "<i8").tofile(path + ".docs"),
        "mask-size": lambda: Path(path + ".mask").write_bytes(b"\1" * 99),
        "documents-type": lambda: meta.update(documents="3"),
        "documents-count": lambda: meta.update(documents=0),
        "targets-type": lambda: meta.update(targets=1),
        "eot-range": lambda: meta.update(eot=256),
    }
    changes[what]()
    Path(path + ".json").write_text(json.dumps(meta))


SIDE_FILE_CASES = {
    "docs-missing": "{p}.docs: not found, but {p}.json records 3 documents in it; write both "
    "again with 'dsnd data prepare'",
    "docs-size": "{p}.docs: 20 bytes hold 2.5 int64 entries, {p}.json says 3 documents (24 "
    "bytes); write it again with 'dsnd data prepare'",
    "docs-first": "{p}.docs: the first document starts at token 3, not 0",
    "docs-last": "{p}.docs: the last document starts at token 100, past the 100 tokens {p}.json "
    "records",
    "docs-order": "{p}.docs: document starts are not strictly increasing (first 0, 50; last 50, "
    "50)",
    "mask-size": "{p}.mask: 99 bytes hold 99 uint8 entries, {p}.json says 100 tokens (100 "
    "bytes); write it again with 'dsnd data prepare'",
    "documents-type": '{p}.json: documents must be an integer, got string "3"',
    "documents-count": "{p}.json: documents must be in 1..tokens (100), got 0",
    "targets-type": "{p}.json: targets must be a boolean, got integer 1",
    "eot-range": "{p}.json: eot 256 is not an id of the vocabulary of 256",
}


@pytest.mark.parametrize("what", SIDE_FILE_CASES)
def test_side_files_that_disagree_with_the_sidecar_are_one_line(tmp_path, what):
    path = write_tokens(tmp_path / "t.bin", np.arange(100), starts=[0, 40, 90], mask=np.ones(100))
    _mutate(path, what)
    want = SIDE_FILE_CASES[what].format(p=path)
    assert _error(check_data, DataConfig(path=path), 256) == want
    assert _error(load_corpus, path) == want


def test_the_full_check_reads_what_start_does_not(tmp_path):
    path = write_tokens(
        tmp_path / "t.bin", np.arange(100), starts=[0, 40, 30, 90], mask=np.r_[np.ones(99), 2]
    )
    load_corpus(path)  # start checks the ends of the starts only
    assert _error(verify_token_file, path) == (
        f"{path}.docs: document starts are not strictly increasing: entry 1 is 40, entry 2 is 30"
    )
    np.array([0, 30, 40, 90], "<i8").tofile(path + ".docs")
    assert _error(verify_token_file, path) == (
        f"{path}.mask: holds 2; a loss mask is 0 or 1 per token"
    )


def test_dsnd_data_verify_runs_the_full_check(tmp_path, capsys):
    from dsnd.cli import main

    path = write_tokens(tmp_path / "t.bin", np.arange(100), starts=[0, 40, 90])
    assert main(["data", "verify", path]) == 0
    assert capsys.readouterr().out.startswith(
        f"{path}: verified 100 tokens (uint16, vocabulary "
        "256): SHA-256, ids, document starts and mask"
    )
    np.arange(1, 101, dtype="<u2").tofile(path)  # same size, other tokens: start cannot tell
    load_corpus(path)
    assert main(["data", "verify", path]) == 2
    assert "does not match" in capsys.readouterr().err


def test_a_masked_label_never_changes_an_input():
    targets = np.ones(100, dtype=bool)
    targets[5] = False
    samples, _ = sample_sets(Corpus(np.arange(100) % 50, "c", "", targets=targets), 8, "stream")
    for rows in ([0], [0, 1]):  # one sample: x and y were views of one row
        x, y = samples.batch(np.array(rows))
        assert x[0].tolist() == list(range(8)) and y[0, 4] == IGNORE_INDEX


def test_a_batch_checks_its_ids_against_the_sidecars_vocabulary(tmp_path):
    ids = np.arange(400) % 256
    ids[250] = 300  # the sidecar says 256
    path = write_tokens(tmp_path / "t.bin", ids)
    check_data(DataConfig(path=path), 256, ModelConfig(seq_len=16))  # reads no token
    samples, _ = sample_sets(load_corpus(path), 16, "stream")
    samples.batch(np.array([0, 1, 2]))
    assert _error(samples.batch, np.array([0, 14])) == (
        f"{path}: sample 14 holds token id 300, outside the vocabulary of 256 its sidecar "
        "records; the metadata does not describe these tokens"
    )


def test_orders_past_the_table_are_a_keyed_permutation():
    for n in (1, 2, 3, 1000, 4099):
        keys = np.arange(4, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        assert sorted(feistel(n, keys, np.arange(n)).tolist()) == list(range(n))
    n, some = TABLE_SAMPLES + 12345, np.arange(0, TABLE_SAMPLES + 12345, 11)
    first = epoch_samples(n, 7, 0, some)  # past the table: no permutation of n is drawn
    assert len(np.unique(first)) == len(some) and 0 <= first.min() and first.max() < n
    assert not np.array_equal(first, epoch_samples(n, 7, 1, some))  # epochs differ
    assert abs(np.corrcoef(some, first)[0, 1]) < 0.01  # shuffled
    # up to the table size the order is exactly what it always was (resumes keep their data)
    stream = np.concatenate([np.random.default_rng([5, e]).permutation(1000) for e in range(3)])
    for step in (0, 1, 2):
        assert np.array_equal(
            global_batch_indices(1000, 700, 5, step), stream[700 * step : 700 * (step + 1)]
        )


def test_token_file_packing_trains_through_the_sampler(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(3400) % 256, starts=np.arange(0, 3400, 50))
    corpus = load_data(DataConfig(path=path, packing="documents"), ModelConfig())
    samples, _ = sample_sets(corpus, 16, "documents")
    ((x, y),) = batch_for_step(samples, 0, 2, 4, 1, 4, 1)
    assert x.shape == (1, 16) and (y == IGNORE_INDEX).sum() <= 1
