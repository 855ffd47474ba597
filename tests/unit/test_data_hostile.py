"""Hostile data: every malformed corpus, sidecar or `dsnd data prepare` argument is one line
(`dsnd: error: ...`, exit 2) naming the file and the numbers, never a traceback or a run that
trains on garbage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsnd import cli
from dsnd.config.schema import DataConfig
from dsnd.data.check import check_data
from dsnd.data.corpus import load_corpus
from dsnd.data.token_file import read_token_file
from dsnd.data.token_writer import write_token_file
from dsnd.data.verify import verify_token_file
from dsnd.errors import UserError
from tests.procs import rank_env

ROOT = os.geteuid() == 0  # permissions do not stop root


def _prepare_error(capsys, *args: str) -> str:
    """Run `dsnd data prepare ARGS` in-process; return its one error line (without the prefix)."""
    assert cli.main(["data", "prepare", *map(str, args)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("dsnd: error: ")
    return lines[0].removeprefix("dsnd: error: ")


def _token_file(tmp_path: Path, ids=range(100), vocab: int = 256) -> str:
    path = str(tmp_path / "t.bin")
    write_token_file(path, np.asarray(ids), vocab, "byte", "test")
    return path


def _edit_meta(path: str, **changes) -> None:
    """Rewrite the sidecar of `path` with `changes` (a value of ... deletes the key)."""
    meta = json.loads(Path(path + ".json").read_text())
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v is not ...}
    Path(path + ".json").write_text(json.dumps(meta))


def _rewrite_bin(path: str, data: bytes, **changes) -> None:
    """Replace the token bytes and keep the sidecar honest about them (sha256, count)."""
    Path(path).write_bytes(data)
    _edit_meta(path, sha256=hashlib.sha256(data).hexdigest(), **changes)


def _check(path: str | None, vocab: int = 256, fmt: str = "auto") -> None:
    check_data(DataConfig(path=path, format=fmt), vocab)


def _error(call, *args, **kwargs) -> str:
    """The message of the UserError that `call(*args, **kwargs)` raises."""
    with pytest.raises(UserError) as e:
        call(*args, **kwargs)
    return str(e.value)


# --- dsnd data prepare ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        (
            b'{"text": "ab\\ud800"}',
            "field 'text' holds a lone surrogate '\\ud800' at character 2, "
            "which has no UTF-8 encoding",
        ),
        (
            b"[" * 100_000,
            "JSON nested too deeply to read; expected a JSON object with field 'text'",
        ),
        (
            b'{"text": "x", "n": ' + b"1" * 5000 + b"}",
            "JSON not readable (Exceeds the limit (4300 digits) for integer string conversion: "
            "value has 5000 digits); expected a JSON object with field 'text'",
        ),
        (b'{"text": "\xff"}', "not valid UTF-8; expected a JSON object with field 'text'"),
    ],
)
def test_prepare_bad_jsonl_record_names_file_and_line(tmp_path, capsys, line, message):
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    assert _prepare_error(capsys, src, tmp_path / "o.bin") == f"{src}:2: {message}"
    assert _error(load_corpus, str(src)) == f"{src}:2: {message}"


def test_prepare_empty_input(tmp_path, capsys):
    src = tmp_path / "empty.txt"
    src.write_bytes(b"")
    assert _prepare_error(capsys, src, tmp_path / "o.bin") == (
        f"INPUT {src}: no text to tokenize (0 bytes)"
    )
    assert not (tmp_path / "o.bin").exists()


def test_prepare_input_missing_or_a_directory(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert _prepare_error(capsys, missing, tmp_path / "o.bin") == (
        f"INPUT: file not found: {missing}"
    )
    assert _prepare_error(capsys, tmp_path, tmp_path / "o.bin") == (
        f"INPUT: not a regular file: {tmp_path}"
    )


def test_prepare_output_a_directory_or_under_a_file(tmp_path, capsys):
    src = tmp_path / "d.txt"
    src.write_text("some text")
    (tmp_path / "outdir").mkdir()
    assert _prepare_error(capsys, src, tmp_path / "outdir") == (
        f"{tmp_path / 'outdir'}: cannot write the token file (Is a directory)"
    )
    out = tmp_path / "d.txt" / "o.bin"
    assert _prepare_error(capsys, src, out) == (
        f"{out}: cannot write the token file ({src} is not a directory)"
    )


def test_prepare_output_in_a_read_only_directory(tmp_path, capsys):
    src = tmp_path / "d.txt"
    src.write_text("some text")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if not ROOT:
        assert _prepare_error(capsys, src, ro / "o.bin") == (
            f"{ro / 'o.bin'}: cannot write the token file (Permission denied)"
        )
        return
    # root writes through file modes: a read-only mount in a mount namespace of its own
    mount = f'mount --bind "{ro}" "{ro}" && mount -o remount,ro,bind "{ro}" "{ro}" && exec "$@"'
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            mount,
            "sh",
            sys.executable,
            "-m",
            "dsnd",
            "data",
            "prepare",
            str(src),
            str(ro / "o.bin"),
        ],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"dsnd: error: {ro / 'o.bin'}: cannot write the token file (Read-only file system)"
    ], proc.stderr


def test_prepare_refuses_to_overwrite_its_input(tmp_path, capsys):
    src = tmp_path / "docs.json"
    src.write_text('{"text": "keep me"}\n')
    for out in (src, tmp_path / "docs"):  # docs: its sidecar would be docs.json, the input
        error = _prepare_error(capsys, src, out)
        assert error == f"OUT {out}: writing {src} would overwrite INPUT {src}"
    assert src.read_text() == '{"text": "keep me"}\n'


def test_prepare_bad_tokenizer_directory(tmp_path, capsys):
    src = tmp_path / "d.txt"
    src.write_text("some text")
    out = tmp_path / "o.bin"
    nowhere = tmp_path / "no-such-tokenizer"
    assert _prepare_error(capsys, src, out, "--tokenizer", nowhere) == (
        f"--tokenizer {nowhere}: not a directory; expected 'byte' or a local transformers "
        "tokenizer directory"
    )
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")  # valid JSON, not a tokenizer: a KeyError inside
    assert _prepare_error(capsys, src, out, "--tokenizer", broken) == (
        f"--tokenizer {broken}: not a local transformers tokenizer (KeyError: 'added_tokens')"
    )
    (broken / "tokenizer.json").write_text("[]")  # a TypeError inside
    assert _prepare_error(capsys, src, out, "--tokenizer", broken).startswith(
        f"--tokenizer {broken}: not a local transformers tokenizer (TypeError: "
    )
    assert not out.exists()


# --- check_data: the model's vocabulary against the corpus's ids --------------------------------


def test_byte_corpus_needs_256_ids(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"text": "hello"}\n')
    for path in (str(text), str(docs)):
        assert _error(_check, path, vocab=100) == (
            f"data.path={path}: byte tokens have ids up to 255 >= model.vocab_size 100 "
            "(set model.vocab_size to at least 256)"
        )
        _check(path, vocab=256)
    assert _error(_check, None, vocab=255) == (
        "data.path=null (the Python standard library's sources): byte tokens have ids up to "
        "255 >= model.vocab_size 255 (set model.vocab_size to at least 256)"
    )
    _check(None, vocab=300)


def test_token_file_vocabulary_larger_than_the_model(tmp_path):
    path = _token_file(tmp_path, vocab=50257)
    assert _error(_check, path, vocab=256) == (
        f"data.path={path}: tokens from a vocabulary of 50257, the model has 256"
    )
    _check(path, vocab=50257)


def test_honest_token_files_pass(tmp_path):
    path = _token_file(tmp_path, ids=np.arange(3000) % 256)
    _check(path)
    _check(path, fmt="tokens")
    for dtype in ("int32", "int64", "uint8", "uint32"):  # other tools' dtypes, with the same ids
        _rewrite_bin(path, (np.arange(3000) % 256).astype(dtype).tobytes(), dtype=dtype)
        _check(path)
        assert load_corpus(path).tokens.tolist() == (np.arange(3000) % 256).tolist()


# --- verify_token_file: the full check, which reads every token (start-up does not) ------------


def test_ids_above_the_sidecars_vocabulary(tmp_path):
    path = _token_file(tmp_path, ids=[1, 2, 300, 4], vocab=256)  # honest sha, lying vocab_size
    assert _error(verify_token_file, path) == (
        f"{path}: largest token id 300 >= vocab_size 256 recorded in {path}.json; the metadata "
        "does not describe these tokens"
    )


def test_negative_ids_of_a_signed_dtype(tmp_path):
    path = _token_file(tmp_path)
    _rewrite_bin(path, np.array([3, -5, 7], dtype=np.int32).tobytes(), dtype="int32", tokens=3)
    assert _error(verify_token_file, path) == (
        f"{path}: smallest token id -5 is negative (int32 tokens)"
    )


def test_changed_bytes_fail_the_sha256(tmp_path):
    path = _token_file(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[10] ^= 1
    Path(path).write_bytes(bytes(data))
    recorded = json.loads(Path(path + ".json").read_text())["sha256"]
    assert _error(verify_token_file, path) == (
        f"{path}: SHA-256 {hashlib.sha256(data).hexdigest()[:16]}... does not match "
        f"{recorded[:16]}... recorded in {path}.json; the file changed after "
        "'dsnd data prepare' wrote it"
    )


# --- the sidecar's schema and sizes: check_data and load_corpus say the same line ----------------

SIDECAR_CASES = [
    (
        {"dtype": "float32"},
        "dtype 'float32' is not a token id type; expected one of uint8, "
        "uint16, uint32, int32, int64",
    ),
    (
        {"dtype": "int8"},
        "dtype 'int8' is not a token id type; expected one of uint8, uint16, uint32, int32, int64",
    ),
    (
        {"dtype": "foo"},
        "dtype 'foo' is not a token id type; expected one of uint8, uint16, uint32, int32, int64",
    ),
    ({"dtype": 16}, "dtype must be a string, got integer 16"),
    (
        {"dtype": ...},
        "missing dtype (needs dtype, vocab_size, tokens, sha256); write it again "
        "with 'dsnd data prepare'",
    ),
    (
        {"vocab_size": ..., "sha256": ...},
        "missing vocab_size, sha256 (needs dtype, vocab_size, "
        "tokens, sha256); write it again with 'dsnd data "
        "prepare'",
    ),
    ({"vocab_size": "256"}, 'vocab_size must be an integer, got string "256"'),
    ({"vocab_size": 256.0}, "vocab_size must be an integer, got number 256.0"),
    ({"vocab_size": True}, "vocab_size must be an integer, got boolean true"),
    ({"vocab_size": 0}, "vocab_size must be at least 1, got 0"),
    ({"tokens": [100]}, "tokens must be an integer, got array"),
    ({"tokens": -1}, "tokens must be at least 0, got -1"),
    ({"sha256": None}, "sha256 must be a string, got null"),
    ({"sha256": "abc"}, "sha256 must be 64 lowercase hex digits, got 'abc'"),
]


@pytest.mark.parametrize("changes, message", SIDECAR_CASES)
def test_sidecar_schema(tmp_path, changes, message):
    path = _token_file(tmp_path)
    _edit_meta(path, **changes)
    for check in (_check, load_corpus):
        assert _error(check, path) == f"{path}.json: {message}"


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "expected a JSON object with keys dtype, vocab_size, tokens, sha256, got array"),
        (
            "{",
            "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
            "(char 1))",
        ),
    ],
)
def test_sidecar_not_an_object(tmp_path, content, message):
    path = _token_file(tmp_path)
    Path(path + ".json").write_text(content)
    for check in (_check, load_corpus):
        assert _error(check, path) == f"{path}.json: {message}"


def test_sizes_against_the_sidecar(tmp_path):
    path = _token_file(tmp_path)  # 100 uint16 tokens
    _edit_meta(path, tokens=120)
    cases = [(f"{path}: 200 bytes hold 100 uint16 tokens, {path}.json says 120", None)]
    cases.append(
        (
            f"{path}: 201 bytes is not a whole number of uint16 tokens (2 bytes each)",
            Path(path).read_bytes() + b"\0",
        )
    )
    cases.append(
        (
            f"{path}: empty (0 bytes), {path}.json says 120 tokens; write it again with "
            "'dsnd data prepare'",
            b"",
        )
    )
    for message, data in cases:
        if data is not None:
            Path(path).write_bytes(data)
        for check in (_check, load_corpus, lambda p: read_token_file(p, None)):
            assert _error(check, path) == message


def test_token_file_missing_or_a_directory(tmp_path):
    path = _token_file(tmp_path)
    os.remove(path)
    assert _error(_check, path) == f"data.path: file not found: {path}"
    assert _error(read_token_file, path, None) == f"token file: file not found: {path}"
    os.mkdir(path)
    assert _error(load_corpus, path) == f"data.path: not a regular file: {path}"
