"""The single-process references, computed once per test session for every parity test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsnd.data.token_writer import TokenWriter
from tests.chat_data import chat_jsonl, conversations, word_tokenizer
from tests.distributed.parity import case, run_cases


@pytest.fixture(scope="session")
def chat_sets(tmp_path_factory) -> tuple[str, ...]:
    """Chat JSONL with its own tokenizer, loss on the assistant's tokens only, documents packed
    apart: the run keys of the parity case with masks and packing."""
    tmp = tmp_path_factory.mktemp("chat")
    return (
        f"data.path={chat_jsonl(tmp / 'chat.jsonl', conversations(200))}",
        "data.format=chat",
        f"data.vocab={word_tokenizer(tmp / 'tok')}",
        "data.packing=documents",
    )


@pytest.fixture(scope="session")
def blend_sets(tmp_path_factory) -> tuple[str, ...]:
    """Two token files as `dsnd data prepare` writes them (bytes, document starts), blended 3:1
    and packed by document: the run keys of the parity case with a blend."""
    tmp = tmp_path_factory.mktemp("blend")
    files = []
    for name, words in (("a", "the quick brown fox"), ("b", "lorem ipsum dolor sit amet")):
        writer = TokenWriter(str(tmp / f"{name}.bin"), np.dtype(np.uint16), targets=False)
        for i in range(120):
            writer.begin_document()
            writer.add(np.frombuffer(f"{i}: {words} {i % 5}. ".encode() * 6, dtype=np.uint8))
        writer.finish(256, "byte", name, None)
        files.append(str(tmp / f"{name}.bin"))
    blend = [{"path": files[0], "weight": 3}, {"path": files[1], "weight": 1}]
    return f"data.blend={json.dumps(blend)}", "data.packing=documents"


@pytest.fixture(scope="session")
def single(tmp_path_factory, chat_sets, blend_sets):
    """One rank: the plain-torch references (of the chat data too), dsnd at ZeRO 0 and 3, and a
    user's JSONL corpus."""
    tmp = tmp_path_factory.mktemp("w1")
    corpus = tmp / "docs.jsonl"
    docs = [
        {"text": f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * 4}
        for i in range(200)
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    jsonl = case("w1-jsonl", 0)
    jsonl["sets"].append(f"data.path={corpus}")
    return run_cases(
        tmp,
        1,
        [
            case("ref-llama", None, reference=True),
            case("ref-gpt2", None, "gpt2-tiny", reference=True),
            case("ref-chat", None, reference=True, sets=chat_sets),
            case("ref-chat-stream", None, reference=True, sets=(*chat_sets, "data.packing=stream")),
            case("ref-blend", None, reference=True, sets=blend_sets),
            case("w1-z0", 0),
            case("w1-z3", 3),
            case("w1-gpt2-z0", 0, "gpt2-tiny"),
            jsonl,
        ],
    )
