"""The single-process references, computed once per test session for every parity test."""

from __future__ import annotations

import json

import pytest

from tests.chat_data import chat_jsonl, conversations, word_tokenizer
from tests.distributed.parity import case, run_cases


@pytest.fixture(scope="session")
def chat_sets(tmp_path_factory) -> tuple[str, ...]:
    """Chat JSONL with its own tokenizer, loss on the assistant's tokens only, documents packed
    apart: the run keys of the parity case with masks and packing."""
    tmp = tmp_path_factory.mktemp("chat")
    return (f"data.path={chat_jsonl(tmp / 'chat.jsonl', conversations(200))}",
            "data.format=chat", f"data.vocab={word_tokenizer(tmp / 'tok')}",
            "data.packing=documents")  # fmt: skip


@pytest.fixture(scope="session")
def single(tmp_path_factory, chat_sets):
    """One rank: the plain-torch references (of the chat data too), dsnd at ZeRO 0 and 3, and a
    user's JSONL corpus."""
    tmp = tmp_path_factory.mktemp("w1")
    corpus = tmp / "docs.jsonl"
    docs = [{"text": f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs. " * 4}
            for i in range(200)]  # fmt: skip
    corpus.write_text("\n".join(json.dumps(d) for d in docs))
    jsonl = case("w1-jsonl", 0)
    jsonl["sets"].append(f"data.path={corpus}")
    return run_cases(tmp, 1, [
        case("ref-llama", None, reference=True),
        case("ref-gpt2", None, "gpt2-tiny", reference=True),
        case("ref-chat", None, reference=True, sets=chat_sets),
        case("ref-chat-stream", None, reference=True, sets=(*chat_sets, "data.packing=stream")),
        case("w1-z0", 0),
        case("w1-z3", 3),
        case("w1-gpt2-z0", 0, "gpt2-tiny"),
        jsonl,
    ])  # fmt: skip
