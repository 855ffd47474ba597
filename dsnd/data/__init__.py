"""Data: corpora, tokenizers, token files and blends, as samples ordered by (seed, step)."""

from dsnd.data.corpus import FORMATS, Corpus, load_corpus
from dsnd.data.sampler import SampleSet, batch_for_step, global_batch_indices, micro_batches
from dsnd.data.tokenizer import ByteTokenizer

__all__ = [
    "FORMATS",
    "ByteTokenizer",
    "Corpus",
    "SampleSet",
    "batch_for_step",
    "global_batch_indices",
    "load_corpus",
    "micro_batches",
]
