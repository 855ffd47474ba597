"""The pre-start data check: what would otherwise fail only after every rank has joined the process
group (an index error deep in the embedding, a step of garbage from a mislabelled dtype).

`check_data` maps a token file (or each of a blend) and checks its sidecar, sizes and side files
without reading its tokens — a start that costs the same for any size; the SHA-256 and id range
are `dsnd.data.verify`'s explicit check, and each gathered batch's ids are checked as training
reads them — or loads a text or JSONL corpus as training will (a malformed record is found here,
file:line, not after every rank has started), so every rank can run it before `init_world`.
Each failure is one `UserError` naming the file and the numbers.
"""

from __future__ import annotations

from dsnd.config.schema import DataConfig, ModelConfig
from dsnd.data.batch_extras import sample_sets
from dsnd.data.blend_files import load_blend
from dsnd.data.corpus import Corpus, corpus_format, token_corpus
from dsnd.data.counted import counted_line
from dsnd.data.sampler import SampleSet
from dsnd.data.sources import data_tokenizer, load_data
from dsnd.data.token_file import check_vocab, meta_path
from dsnd.data.tokenizer import BYTE, ByteTokenizer, has_tokenizer, same_tokenizer
from dsnd.errors import UserError


def check_data(data: DataConfig, model_vocab: int, model: ModelConfig | None = None) -> None:
    """Refuse a corpus the model cannot train on: a bad path or format, a vocabulary smaller than
    the corpus's token ids, a token file whose sidecar does not describe it, data not tokenized
    with the tokenizer of the pretrained weights of `model.init_from`, or document packing of
    data without document boundaries."""
    model = model or ModelConfig()
    if data.blend is not None:
        for i, part in enumerate(load_blend(data).parts):
            _check_token_corpus(part, data, model, model_vocab, f"data.blend[{i}].path")
        return
    fmt = corpus_format(data.path, data.format)
    if fmt == "tokens":
        _check_token_corpus(token_corpus(data.path, data.max_bytes), data, model, model_vocab)
        return
    tokenizer = data_tokenizer(data, model)
    check_tokenizer_match(data, model, tokenizer, "the data is tokenized with")
    if tokenizer == BYTE:
        check_byte_vocab(data.path, model_vocab)
    corpus = load_data(data, model)
    _check_packing(data, corpus.documents)
    check_vocab(corpus.vocab_size, model_vocab, data.path)
    if corpus.targets is not None:  # chat data: nothing to count is refused now, not at step 1
        counted_line(corpus, sample_sets(corpus, model.seq_len, data.packing)[0], data.packing)


def check_tokenizer_match(
    data: DataConfig, model: ModelConfig, tokenizer: str, said: str, key: str | None = None
) -> None:
    """Pretrained weights read ids as their tokenizer's: data with ids of another (bytes, by
    default) trains them on scrambled text, so it is refused unless
    data.allow_vocab_mismatch says it is meant. `key` names the data (default data.path's)."""
    own = model.init_from if has_tokenizer(model.init_from) else None
    if own is None or data.allow_vocab_mismatch or same_tokenizer(tokenizer, own):
        return
    if key is None:
        path = (
            data.path if data.path is not None else "null (the Python standard library's sources)"
        )
        key = f"data.path={path}"
    what = "byte tokens" if tokenizer == BYTE else f"the tokenizer of {tokenizer}"
    raise UserError(
        f"{key}: {said} {what}, but model.init_from={own} has its own "
        "tokenizer; set data.vocab: model to tokenize the data with it, or "
        "data.allow_vocab_mismatch: true to train on it as is"
    )


def _check_token_corpus(
    corpus: Corpus, data: DataConfig, model: ModelConfig, model_vocab: int, key: str = "data.path"
) -> None:
    """A token file's checks, none of which reads its tokens (`dsnd.data.verify` does): the
    sidecar and the sizes (`token_corpus`), its tokenizer against model.init_from's, document
    boundaries for document packing, its vocabulary against the model's, and one sample."""
    check_tokenizer_match(
        data, model, corpus.tokenizer, f"{meta_path(corpus.name)} names", f"{key}={corpus.name}"
    )
    _check_packing(data, corpus.documents, f"{key}={corpus.name}")
    check_vocab(corpus.vocab_size, model_vocab, corpus.name)
    SampleSet(corpus.tokens, model.seq_len, corpus.name)  # refuses fewer tokens than a sample


def _check_packing(data: DataConfig, documents: object, name: str | None = None) -> None:
    if data.packing == "documents" and documents is None:
        if name is None:
            path = data.path if data.path is not None else "null (the Python standard library)"
            name = f"data.path={path}"
        raise UserError(
            f"data.packing=documents: {name} records no document boundaries; use "
            "JSONL, a Hugging Face dataset, chat data or a token file prepared "
            "with its documents"
        )


def check_byte_vocab(path: str | None, model_vocab: int) -> None:
    """A byte corpus (text, JSONL, the stdlib sources) may hold any of the 256 byte values, so
    the model needs all of them; the text is not read to find out which occur."""
    need = ByteTokenizer.vocab_size
    if model_vocab < need:
        name = path if path is not None else "null (the Python standard library's sources)"
        raise UserError(
            f"data.path={name}: byte tokens have ids up to {need - 1} >= "
            f"model.vocab_size {model_vocab} (set model.vocab_size to at "
            f"least {need})"
        )
