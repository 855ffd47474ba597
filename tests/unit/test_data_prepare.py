"""`dsnd data prepare` streams: the file it writes holds what training reads from the same input
(tokens, end-of-text ids, document starts, the chat loss mask), the same for any number of
workers, in memory that does not grow with the input; a failed prepare leaves no pair."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsnd import cli
from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data import prepare_input
from dsnd.data.corpus import load_corpus
from dsnd.data.prepare import Progress, Spec, prepare
from dsnd.data.sources import load_data
from dsnd.data.tokenizer import load_tokenizer
from tests.chat_data import MARKED_TEMPLATE, TEXTS, chat_jsonl, conversations, word_tokenizer
from tests.procs import ROOT, rank_env


def _prepare(capsys, *args) -> str:
    assert cli.main(["data", "prepare", *map(str, args)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _error(capsys, *args) -> str:
    assert cli.main(["data", "prepare", *map(str, args)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0].removeprefix("dsnd: error: ")


def _written(out) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray | None]:
    """(the sidecar, the tokens, the document starts, the mask or None) of token file `out`."""
    meta = json.loads(open(f"{out}.json").read())
    tokens = np.fromfile(out, dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    starts = np.fromfile(f"{out}.docs", dtype="<i8")
    mask = np.fromfile(f"{out}.mask", dtype=np.uint8) if meta.get("targets") else None
    return meta, tokens, starts, mask


def _starts(documents: np.ndarray) -> list[int]:
    """The first token of each document of a per-token document index."""
    return np.flatnonzero(np.r_[True, documents[1:] != documents[:-1]]).tolist()


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_text_documents_are_written_as_training_reads_them(tmp_path, docs, capsys):
    tok_dir = word_tokenizer(tmp_path / "tok")
    out = tmp_path / "words.bin"
    said = _prepare(capsys, docs, out, "--tokenizer", tok_dir)
    meta, tokens, starts, mask = _written(out)
    read = load_data(DataConfig(path=str(docs), vocab=tok_dir), ModelConfig())
    assert tokens.tolist() == read.tokens.tolist() and mask is None
    assert starts.tolist() == _starts(read.documents) and meta["documents"] == len(TEXTS)
    eos = load_tokenizer(tok_dir).eos_token_id
    assert meta["eot"] == eos and tokens[starts[1:] - 1].tolist() == [eos] * (len(TEXTS) - 1)
    assert f"{len(TEXTS)} documents, end-of-text id {eos}" in said
    # bytes: no spare id; a blank line between documents (the one before belongs to it)
    _prepare(capsys, docs, tmp_path / "bytes.bin")
    meta, tokens, starts, _ = _written(tmp_path / "bytes.bin")
    read = load_corpus(str(docs))
    assert meta["eot"] is None and tokens.tolist() == read.tokens.tolist()
    assert starts.tolist() == _starts(read.documents)


def test_a_hugging_face_dataset_is_written_as_training_reads_it(tmp_path, capsys):
    import datasets

    tok_dir = word_tokenizer(tmp_path / "tok")
    path = tmp_path / "ds"
    rows = {"body": TEXTS, "n": list(range(len(TEXTS)))}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(path)
    out = tmp_path / "ds.bin"
    _prepare(capsys, path, out, "--tokenizer", tok_dir, "--text-field", "body")
    meta, tokens, starts, _ = _written(out)
    read = load_data(DataConfig(path=str(path), text_field="body"), ModelConfig(init_from=tok_dir))
    assert tokens.tolist() == read.tokens.tolist() and meta["documents"] == len(TEXTS)
    assert starts.tolist() == _starts(read.documents)


def test_a_text_file_is_one_document_read_in_chunks(tmp_path, monkeypatch, capsys):
    tok_dir = word_tokenizer(tmp_path / "tok")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(TEXTS) + "\n")
    monkeypatch.setattr(prepare_input, "CHUNK", 100)  # about 30 chunks
    _prepare(capsys, text, tmp_path / "t.bin", "--tokenizer", tok_dir)
    meta, tokens, starts, _ = _written(tmp_path / "t.bin")
    whole = load_data(DataConfig(path=str(text), vocab=tok_dir), ModelConfig())
    assert tokens.tolist() == whole.tokens.tolist() and starts.tolist() == [0]
    assert meta["documents"] == 1 and tokens[-1] == meta["eot"]
    _prepare(capsys, text, tmp_path / "b.bin")
    assert (
        np.fromfile(tmp_path / "b.bin", "<u2").tobytes()
        == np.frombuffer(text.read_bytes(), np.uint8).astype("<u2").tobytes()
    )
    chunks = list(prepare_input.text_chunks(str(text), cut_lines=True, size=100))
    assert b"".join(chunks) == text.read_bytes() and all(c.endswith(b"\n") for c in chunks)


@pytest.mark.parametrize(
    "buf, cut",
    [
        (b"one\ntwo\n\nthree four", 9),
        (b"one two  three", 7),
        ("déjà".encode(), 4),
        ("ab€".encode()[:-1], 2),
        (b"x\n\n", 1),
    ],
)
def test_chunks_end_where_tokenizers_do_not_join(buf, cut):
    assert prepare_input.cut_point(buf) == cut


@pytest.mark.parametrize("template", [None, MARKED_TEMPLATE])
def test_chat_is_written_with_the_mask_training_uses(tmp_path, capsys, template):
    tok_dir = word_tokenizer(tmp_path / "tok", *([template] if template else []))
    chat = chat_jsonl(tmp_path / "chat.jsonl")
    said = _prepare(capsys, chat, tmp_path / "c.bin", "--format", "chat", "--tokenizer", tok_dir)
    meta, tokens, starts, mask = _written(tmp_path / "c.bin")
    read = load_data(DataConfig(path=chat, format="chat"), ModelConfig(init_from=tok_dir))
    assert tokens.tolist() == read.tokens.tolist() and mask.tolist() == read.targets.tolist()
    assert starts.tolist() == _starts(read.documents) and meta["targets"] is True
    counted = int(read.targets.sum())
    share = f"{100 * counted / len(tokens):.1f}%"
    assert f"counted: {counted} of {len(tokens)} tokens ({share})" in said


def test_chat_with_nothing_to_count_is_refused(tmp_path, capsys):
    tok_dir = word_tokenizer(tmp_path / "tok")
    asked = [[{"role": "user", "content": "what is a fox"}]] * 3
    chat = chat_jsonl(tmp_path / "chat.jsonl", asked)
    out = tmp_path / "c.bin"
    assert _error(capsys, chat, out, "--format", "chat", "--tokenizer", tok_dir) == (
        f"INPUT {chat}: no token of its 3 conversations counts in the loss (no assistant turn); "
        "chat data trains on the assistant's tokens"
    )
    assert not list(tmp_path.glob("c.bin*"))
    assert _error(capsys, chat, out, "--format", "chat") == (
        "--format chat: byte tokens have no chat template; pass --tokenizer DIR, a tokenizer "
        "with one"
    )


def test_any_number_of_workers_writes_the_same_file(tmp_path, monkeypatch, capsys, docs):
    tok_dir = word_tokenizer(tmp_path / "tok")
    chat = chat_jsonl(tmp_path / "chat.jsonl")
    monkeypatch.setattr(prepare_input, "CHAT_ITEMS", 2)  # 15 batches over the workers
    monkeypatch.setattr(prepare_input, "BATCH_ITEMS", 3)
    for source, fmt in ((chat, "chat"), (docs, "jsonl")):
        files = []
        for workers in (1, 2):
            out = tmp_path / f"{fmt}{workers}.bin"
            _prepare(
                capsys, source, out, "--format", fmt, "--tokenizer", tok_dir, "--workers", workers
            )
            files.append(
                [
                    (tmp_path / f"{out.name}{end}").read_bytes()
                    for end in ("", ".docs", ".mask" if fmt == "chat" else "")
                ]
            )
        assert files[0] == files[1]
    bad = tmp_path / "bad.jsonl"  # an error in a worker: the earliest, as with one process
    convs = conversations(8)
    convs[3] = [{"role": "user"}]
    convs[6] = [{"role": "assistant"}]
    chat_jsonl(bad, convs)
    for workers in (1, 2):
        assert _error(
            capsys,
            bad,
            tmp_path / "x.bin",
            "--format",
            "chat",
            "--tokenizer",
            tok_dir,
            "--workers",
            workers,
        ).startswith(f"{bad}:4: message 0 ")


def test_a_failed_prepare_leaves_no_pair(tmp_path, docs, capsys):
    out = tmp_path / "o.bin"
    _prepare(capsys, docs, out)  # an earlier, whole pair
    with open(docs, "a") as f:
        f.write('{"text": 7}\n')
    assert _error(capsys, docs, out) == (
        f"{docs}:{len(TEXTS) + 1}: field 'text' must be a string, got int"
    )
    assert not list(tmp_path.glob("o.bin*"))  # the old sidecar first: never a stale pair


def test_progress_and_preview(tmp_path, capsys, docs):
    tok_dir = word_tokenizer(tmp_path / "tok")
    stream = io.StringIO()
    meta, _ = prepare(Spec(str(docs), "jsonl"), str(tmp_path / "o.bin"), 1, Progress(stream, 0))
    assert (
        stream.getvalue()
        .splitlines()[-1]
        .startswith(f"prepare: {len(TEXTS)} documents, {meta['tokens']} tokens, 0.0 MB of text, ")
    )
    chat = chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "c.bin"
    said = _prepare(capsys, chat, out, "--format", "chat", "--tokenizer", tok_dir, "--preview", 2)
    assert said.splitlines()[:2] == [
        f"=== document 0 ({chat}:1): 21 tokens, 9 counted (the others in [[...]])",
        "[[<|user|> what is a fox 0 <|end|> <|assistant|>]]the quick brown fox 0 <|end|>"
        "[[<|user|> hello <|end|> <|assistant|>]]lazy dogs <|end|>",
    ]
    assert said.count("=== document") == 2 and not out.exists()
    said = _prepare(capsys, docs, "--preview", 1)
    assert (
        said == f"=== document 0 ({docs}:1): {len(TEXTS[0]) + 2} tokens, all counted\n"
        f"{TEXTS[0]}\n\n(preview: nothing written)\n"
    )


def test_bad_arguments_are_one_line(tmp_path, docs, capsys):
    assert _error(capsys, docs) == (
        "OUT: name the token file to write (e.g. train.bin), or "
        "pass --preview N to look at the first N documents"
    )
    assert _error(capsys, docs, tmp_path / "o.bin", "--workers", 0) == (
        "--workers must be at least 1, got 0"
    )
    assert not (tmp_path / "o.bin").exists()


_RSS = """
import json, resource, sys
from dsnd.commands.data import run_prepare
peaks = []
for src in sys.argv[1:]:
    run_prepare(src, src + ".bin", "auto", "text", "byte")
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
print(json.dumps(peaks))
"""


def test_memory_does_not_grow_with_the_input(tmp_path):
    """One process prepares 4 MB, then 16 MB: its peak RSS grows by far less than the 12 MB more
    input (reading it whole, the peak grew by about 10 bytes per input byte)."""
    record = json.dumps({"text": "pack my box with five dozen liquor jugs. " * 100}) + "\n"
    paths = []
    for name, mb in (("small", 4), ("large", 16)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(record * (mb * 10**6 // len(record)))
        paths.append(str(path))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RSS), *paths],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    small, large = json.loads(proc.stdout.splitlines()[-1])
    assert large - small < 6, (small, large)  # MB
