"""Small chat and text data with a word-level tokenizer of its own, built locally (nothing is
downloaded), for the data tests and the parity case with masks and document packing."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXTS = [
    f"doc {i} the quick brown fox {'jumps ' * (i % 5)}over {i % 3} lazy dogs" for i in range(60)
]
SPECIAL = ["[UNK]", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
# no {% generation %} blocks, as most published templates: the mask comes from prefixes
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
MARKED_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }} <|end|> {% endgeneration %}{% else %}"
    "{{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def word_tokenizer(path, template: str | None = PLAIN_TEMPLATE) -> str:
    """A word-level tokenizer of TEXTS' words (EOS </s>, chat template `template`) saved in
    `path`, as save_pretrained writes it."""
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(
        TEXTS + ["hello what is a fox"], trainers.WordLevelTrainer(special_tokens=SPECIAL)
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>")
    tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


def conversations(count: int = 30) -> list[list[dict]]:
    return [
        [
            {"role": "user", "content": f"what is a fox {i}"},
            {"role": "assistant", "content": f"the quick brown fox {i % 3}"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "lazy dogs " * (1 + i % 2)},
        ]
        for i in range(count)
    ]


def chat_jsonl(path, convs=None) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs or conversations()))
    return str(path)
