"""Data: a corpus of byte tokens, cut into samples whose order depends on (seed, step) only."""

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
