"""What a step's micro-batches carry besides tokens and labels, when not every label counts or
documents are packed apart — computed from (seed, step) alone, like the samples, so every rank
(every pipeline stage included) knows it without a message.

Loss normalisation. The loss of a step is the mean over the counted labels of the whole global
batch: L = S / N, S the summed token losses, N the number of labels that count (not -100).
Each micro-batch's loss is its own mean over its n_m counted labels, and every layout
averages micro-batch losses: over the gas micro-batches of a rank (DeepSpeed's 1/gas) and over
the dp ranks (the gradient average). Weighting micro-batch m's mean by w_m = n_m · M / N (M =
gas · dp micro-batches in the global batch) makes that average S / N whatever the layout, with
one process (gas = M) as with many. With every label counted, n_m · M = N and w_m is exactly 1,
so unmasked runs keep their numbers bit for bit. A micro-batch with no counted label weighs 0
(its mean would be 0/0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsnd.data.blend import BlendedCorpus, BlendedSamples
from dsnd.data.corpus import Corpus
from dsnd.data.sampler import Samples, SampleSet


@dataclass(frozen=True)
class BatchExtras:
    """One rank's micro-batches of a step: the loss weight w_m of each (module docstring), and
    with document packing the document index of each input token, (micro, seq_len) each."""

    weights: tuple[float, ...]
    documents: tuple[torch.Tensor, ...] | None = None


def batch_extras(
    samples: Samples, seed: int, step: int, global_batch: int, dp_rank: int, dp: int, micro: int
) -> BatchExtras | None:
    """Rank `dp_rank`'s `BatchExtras` of global step `step` (None where every label counts and
    no documents are kept apart: the plain mean, as without it), for the micro-batches
    `batch_for_step` gives with the same arguments."""
    if not samples.masked:
        return None
    indices = samples.step_indices(global_batch, seed, step)
    counts = samples.label_counts(indices).reshape(-1, micro).sum(axis=1)
    total = int(counts.sum())
    per_rank = len(counts) // dp
    mine = counts[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    weights = tuple(float(int(n) * len(counts)) / total if total else 0.0 for n in mine)
    docs = None
    if samples.document_ids(indices[:1]) is not None:
        first = dp_rank * per_rank * micro
        docs = tuple(
            samples.document_ids(indices[first + k * micro : first + (k + 1) * micro])
            for k in range(per_rank)
        )
    return BatchExtras(weights, docs)


def fewest_samples(corpus: Corpus | BlendedCorpus, seq_len: int) -> int:
    """The windows of `seq_len + 1` tokens of the corpus (of a blend's smallest file: the one
    a held-out share is the fewest samples of)."""
    parts = corpus.parts if isinstance(corpus, BlendedCorpus) else (corpus,)
    return min(len(p.tokens) for p in parts) // (seq_len + 1)


def sample_sets(
    corpus: Corpus | BlendedCorpus, seq_len: int, packing: str, held_out: float | None = None
) -> tuple[Samples, Samples | None]:
    """The corpus's training samples and, with a `held_out` fraction, the held-out last share
    of its windows (at least one; of each file, for a blend, blended by the same weights).
    `packing` "documents" keeps documents apart. Nothing here reads the tokens: a token file's
    windows, mask and document starts stay memory-mapped views."""
    if isinstance(corpus, BlendedCorpus):
        pairs = [sample_sets(part, seq_len, packing, held_out) for part in corpus.parts]
        train = BlendedSamples([p[0] for p in pairs], corpus.weights, corpus.name)
        if held_out is None:
            return train, None
        return train, BlendedSamples(
            [p[1] for p in pairs], corpus.weights, f"{corpus.name} (held out)"
        )
    documents = corpus.documents if packing == "documents" else None
    vocab = corpus.vocab_size
    if held_out is None:
        return SampleSet(
            corpus.tokens, seq_len, corpus.name, corpus.targets, documents, vocab
        ), None
    window = seq_len + 1
    count = len(corpus.tokens) // window
    cut = (count - max(1, int(count * held_out))) * window

    def part(lo: int, hi: int | None, name: str) -> SampleSet:
        pick = [None if a is None else a[lo:hi] for a in (corpus.targets, documents)]
        return SampleSet(corpus.tokens[lo:hi], seq_len, name, *pick, vocab)

    return part(0, cut, corpus.name), part(cut, None, f"{corpus.name} (held out)")
