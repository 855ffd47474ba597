"""Which samples a run trains on and which it evaluates on: one answer for the trainer, the
single-process reference and anything else that must see a run's samples.

- `data.eval_path` set: the whole of `data.path` trains, the evaluation samples are that file's
  (read like data.path: same format, tokenizer and packing);
- else `eval.fraction` > 0: the last share of the corpus's samples is held out (never trained
  on) and the rest trains: the default, so that every run has a validation loss;
- else (`eval.fraction` 0): everything trains and nothing is evaluated.

A corpus with too few samples to hold out a whole one at `eval.fraction` trains on everything
and is not evaluated; `Split.note` says so (rank 0 logs it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dsnd.config.schema import DataConfig, RunConfig
from dsnd.data.batch_extras import fewest_samples, sample_sets
from dsnd.data.blend import BlendedCorpus
from dsnd.data.corpus import Corpus
from dsnd.data.sampler import Samples
from dsnd.data.sources import load_data


@dataclass(frozen=True)
class Split:
    train: Samples
    held_out: Samples | None  # None: nothing to evaluate on
    note: str | None = None  # why nothing is evaluated although eval.fraction asked for it


def held_out_count(samples: int, fraction: float) -> int:
    """Samples held out of `samples` at `fraction` (whole samples, rounded down)."""
    return int(samples * fraction)


def split_samples(
    run: RunConfig, corpus: Corpus | BlendedCorpus, eval_corpus: Corpus | None = None
) -> Split:
    """The run's training and evaluation samples of `corpus` (`eval_corpus`: data.eval_path's
    corpus, when set; loaded by `load_eval_corpus`). A blend holds out the share of each of its
    files, so its smallest file decides whether there is a sample to hold out."""
    seq_len, packing = run.model.seq_len, run.data.packing
    if eval_corpus is not None:
        return Split(
            sample_sets(corpus, seq_len, packing)[0], sample_sets(eval_corpus, seq_len, packing)[0]
        )
    fraction = run.eval.fraction
    samples = fewest_samples(corpus, seq_len)  # a blend's: its smallest file's
    if fraction <= 0 or held_out_count(samples, fraction) < 1:
        note = (
            None
            if fraction <= 0
            else (
                f"not evaluating: {corpus.name} has {samples} samples of {seq_len} tokens, too few "
                f"to hold out eval.fraction {fraction} of them (at least {math.ceil(1 / fraction)} "
                "needed); set data.eval_path, or a larger eval.fraction"
            )
        )
        return Split(sample_sets(corpus, seq_len, packing)[0], None, note)
    return Split(*sample_sets(corpus, seq_len, packing, fraction))


def load_eval_corpus(run: RunConfig) -> Corpus | None:
    """data.eval_path's corpus, read as data.path is (None when unset)."""
    if not run.data.eval_path:
        return None
    return load_data(eval_data(run), run.model)


def eval_data(run: RunConfig) -> DataConfig:
    """The data section that reads data.eval_path as data.path (a blend's files not with it)."""
    return dataclasses.replace(run.data, path=run.data.eval_path, blend=None)
