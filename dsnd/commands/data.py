"""``dsnd data prepare INPUT OUT.bin``: tokenize a text file, JSONL, a Hugging Face dataset or
chat data once, into a token file (`dsnd.data.token_file`) that training memory-maps; streamed,
in memory that does not grow with the input (`dsnd.data.prepare`).

--tokenizer byte (default) is dsnd's byte-level tokenizer (ids 0..255, what the presets use);
--tokenizer DIR loads any `transformers` tokenizer saved in a local directory (nothing is
downloaded); a model trained on it needs a vocabulary at least as large. --preview N prints the
first N documents as they would be written, with what counts in the loss, and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dsnd.data.chat import check_template
from dsnd.data.corpus import corpus_format
from dsnd.data.prepare import Progress, Spec, prepare
from dsnd.data.prepare_preview import preview as show_preview
from dsnd.data.token_file import meta_path
from dsnd.data.token_writer import DOCS_SUFFIX, MASK_SUFFIX
from dsnd.data.tokenizer import BYTE, load_tokenizer
from dsnd.data.verify import verify_token_file
from dsnd.errors import EXIT_INTERRUPTED, UserError

MAX_WORKERS = 8


def default_workers() -> int:
    return min(os.cpu_count() or 1, MAX_WORKERS)


def _check_output(source: str, out: str) -> None:
    """Writing OUT or its companions over INPUT would destroy the input mid-run."""
    for target in (out, meta_path(out), out + DOCS_SUFFIX, out + MASK_SUFFIX):
        if os.path.isfile(target) and os.path.samefile(source, target):
            raise UserError(f"OUT {out}: writing {target} would overwrite INPUT {source}")


def _spec(source: str, fmt: str, text_field: str, split: str, tokenizer: str) -> Spec:
    fmt = corpus_format(source, fmt, what="INPUT")  # "INPUT: file not found", not "data.path"
    if fmt == "tokens":
        raise UserError(f"{source}: already a token file")
    if fmt == "chat" and tokenizer == BYTE:
        raise UserError(
            "--format chat: byte tokens have no chat template; pass --tokenizer "
            "DIR, a tokenizer with one"
        )
    tok = None if tokenizer == BYTE else load_tokenizer(tokenizer)
    if fmt == "chat":
        check_template(tok, tokenizer, "--format chat")
    # the tokenizer's absolute path: training compares it with model.init_from's wherever it runs
    named = tokenizer if tokenizer == BYTE else os.path.abspath(tokenizer)
    return Spec(source, fmt, text_field, split, named, tok)


def run_prepare(
    source: str,
    out: str | None,
    fmt: str = "auto",
    text_field: str = "text",
    tokenizer: str = BYTE,
    split: str = "train",
    workers: int | None = None,
    preview: int = 0,
) -> int:
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if preview < 0:
        raise UserError(f"--preview must be at least 1, got {preview}")
    if out is None and not preview:
        raise UserError(
            "OUT: name the token file to write (e.g. train.bin), or pass "
            "--preview N to look at the first N documents"
        )
    if out is not None:
        _check_output(source, out)
    spec = _spec(source, fmt, text_field, split, tokenizer)
    if preview:
        print(show_preview(spec, preview), end="")
        print("(preview: nothing written)")
        return 0
    start = time.monotonic()
    try:
        meta, counted = prepare(spec, out, workers or default_workers(), Progress())
    except KeyboardInterrupt:
        print(f"dsnd: interrupted; {out} and its companions removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    seconds = time.monotonic() - start
    eot = "no end-of-text id" if meta["eot"] is None else f"end-of-text id {meta['eot']}"
    print(
        f"wrote {out}: {meta['tokens']} tokens ({meta['dtype']}, vocabulary "
        f"{meta['vocab_size']}), {meta['documents']} documents, {eot}, {seconds:.1f} s"
    )
    if meta.get("targets"):
        print(
            f"counted: {counted} of {meta['tokens']} tokens ({100 * counted / meta['tokens']:.1f}%)"
        )
    return 0


def run_verify(path: str) -> int:
    """``dsnd data verify PATH``: the check that reads every byte (training's start reads none)."""
    start = time.monotonic()
    meta = verify_token_file(path)
    print(
        f"{path}: verified {meta['tokens']} tokens ({meta['dtype']}, vocabulary "
        f"{meta['vocab_size']}): SHA-256, ids, document starts and mask as the sidecar "
        f"records, {time.monotonic() - start:.1f} s"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd data prepare`` and ``dsnd data verify``."""
    if args.data_command == "verify":
        return run_verify(args.path)
    return run_prepare(
        args.source,
        args.out,
        args.format,
        args.text_field,
        args.tokenizer,
        args.split,
        args.workers,
        args.preview,
    )
