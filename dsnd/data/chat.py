"""Chat / SFT data: a `messages` list of {role, content} per JSONL line or dataset row, rendered
with the tokenizer's own chat template; only the assistant's tokens count in the loss.

Which tokens are the assistant's:

* a template with ``{% generation %}`` blocks says so itself: transformers'
  ``return_assistant_tokens_mask`` marks the tokens rendered inside them;
* most templates have none (the blocks were added after most models shipped theirs), so the
  mask comes from rendering prefixes: assistant message i spans from the end of
  ``messages[:i]`` rendered with the generation prompt (the assistant's header, which the model
  is given, not asked for) to the end of ``messages[:i + 1]`` (its content and end-of-turn
  tokens, which the model must learn to produce). This needs a template whose rendering of a
  prefix of the conversation is a prefix of its rendering of the whole; one that is not (that
  drops earlier reasoning, say) is refused with the conversation's row or line.

Each conversation is a document (`data.packing: documents` keeps them apart).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from dsnd.data.corpus import Corpus
from dsnd.data.documents import documents_corpus
from dsnd.errors import UserError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_corpus(
    values: Iterable[tuple[str, Any]], tok: Any, max_bytes: int | None, name: str, tokenizer: str
) -> Corpus:
    """Every conversation of `values` ((where, messages) pairs) rendered, until `max_bytes` of
    message text are read, as one corpus whose targets are the assistant tokens."""
    check_template(tok, tokenizer)
    pieces, targets, read = [], [], 0
    for where, messages in values:
        ids, mask = render_conversation(tok, messages, where)
        pieces.append(ids)
        targets.append(mask)
        read += sum(len(m["content"].encode("utf-8", "replace")) for m in messages)
        if max_bytes is not None and read >= max_bytes:
            break
    return documents_corpus(pieces, targets, name, tokenizer, tok)


def check_template(tok: Any, tokenizer: str, what: str = "data.format=chat") -> None:
    """Refuse a tokenizer without a chat template (`what` names the setting that asked)."""
    if not getattr(tok, "chat_template", None):
        raise UserError(
            f"{what}: the tokenizer {tokenizer} has no chat template "
            "(tokenizer_config.json chat_template or chat_template.jinja)"
        )


def render_conversation(tok: Any, messages: Any, where: str) -> tuple[list[int], list[bool]]:
    """(token ids, whether each counts) of one conversation, checked first: a list of
    {role, content} messages (`where` names its line or row in errors)."""
    _check_messages(messages, where)
    marked = _GENERATION.search(str(tok.chat_template))
    return (_marked if marked else _by_prefixes)(tok, messages, where)


def _check_messages(messages: Any, where: str) -> None:
    """A non-empty list of {role: str, content: str} objects, or one line naming `where`."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else type(messages).__name__
        raise UserError(
            f"{where}: messages must be a non-empty list of {{role, content}} objects, got {got}"
        )
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not all(
            isinstance(m.get(f), str) for f in ("role", "content")
        ):
            raise UserError(
                f"{where}: message {k} must have string role and content, got {str(m)[:80]}"
            )


def _render(tok: Any, messages: list, where: str, **kwargs: Any) -> Any:
    """The template's rendering (a dict with input_ids); its failures name `where`."""
    try:
        return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as e:  # a template error: jinja's, or the template's own raise_exception
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(
            f"{where}: the chat template cannot render this conversation "
            f"({type(e).__name__}: {first})"
        ) from e


def _marked(tok: Any, messages: list, where: str) -> tuple[list[int], list[bool]]:
    out = _render(tok, messages, where, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _by_prefixes(tok: Any, messages: list, where: str) -> tuple[list[int], list[bool]]:
    ids = list(_render(tok, messages, where)["input_ids"])
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = 0
        if i:
            start = len(_prefix(tok, messages[:i], ids, where, add_generation_prompt=True))
        end = len(_prefix(tok, messages[: i + 1], ids, where))
        mask[start:end] = [True] * (end - start)
    return ids, mask


def _prefix(tok: Any, messages: list, whole: list[int], where: str, **kwargs: Any) -> list[int]:
    part = list(_render(tok, messages, where, **kwargs)["input_ids"])
    if whole[: len(part)] != part:
        raise UserError(
            f"{where}: the chat template renders the first {len(messages)} "
            "messages as other tokens than the start of the whole conversation, so "
            "the assistant's tokens cannot be told apart; use a template with "
            "{% generation %} blocks"
        )
    return part
