"""A pre-tokenized corpus trains exactly like the text it was made from; a vocabulary larger than
the model's is refused before the process group starts."""

from __future__ import annotations

import json
import os

import numpy as np

from dsnd.data.token_writer import write_token_file
from tests.procs import run_cli


def _losses(log_dir) -> list[float]:
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_jsonl_and_its_token_file_train_the_same(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "\n".join(
            json.dumps(
                {
                    "text": f"Record {i}: " + "pack my box with five dozen "
                    f"liquor jugs {i % 11}. " * 3
                }
            )
            for i in range(300)
        )
    )
    assert run_cli(["data", "prepare", str(docs), str(tmp_path / "docs.bin")]).returncode == 0
    runs = {}
    for name, path in (("jsonl", docs), ("tokens", tmp_path / "docs.bin")):
        proc = run_cli(
            [
                "train",
                "--set",
                "train.steps=3",
                "--set",
                f"data.path={path}",
                "--set",
                f"log.dir={tmp_path / name}",
            ],
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = _losses(tmp_path / name)
    assert len(runs["jsonl"]) == 3 and runs["tokens"] == runs["jsonl"]

    big = tmp_path / "big.bin"
    write_token_file(
        str(big), np.arange(5000) % 300, vocab_size=50257, tokenizer="gpt2", source="test"
    )
    proc = run_cli(["train", "--set", f"data.path={big}", "--set", f"log.dir={tmp_path / 'b'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"dsnd: error: data.path={big}: tokens from a vocabulary of 50257, the model has 256"
    )
    # with the model's vocabulary raised to the tokenizer's, it trains
    proc = run_cli(
        [
            "train",
            "--set",
            f"data.path={big}",
            "--set",
            f"log.dir={tmp_path / 'c'}",
            "--set",
            "model.vocab_size=50257",
            "--set",
            "train.steps=2",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = _losses(tmp_path / "c")[0]
    assert abs(first - 10.825) < 0.1  # ln(50257): a fresh model over the larger vocabulary
