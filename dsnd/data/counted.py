"""How much of a corpus counts in the loss, said at start and refused when it is nothing.

Chat data counts the assistant's tokens only (a token file may carry such a mask too): data
with no assistant turn would train at loss 0 with gradient norm 0 and commit checkpoints of an
unchanged model. So a corpus with `targets` (whichever source made them) is refused when no
token of it counts, or when no label of any sample counts (the counted tokens all fall where
no label is: the first token of a sample, the tokens after the last whole sample, or, with
``data.packing: documents``, the first token of a document) — and otherwise its share is one
line at start: ``data: N of M tokens counted in the loss (x%)``.

Both read the mask in chunks (a token file's stays memory-mapped); the sample check stops at
the first chunk holding a counted label, so it costs a whole pass only when it refuses. A token
file's mask is not counted at start where its sidecar records the count (``dsnd data prepare``
writes it); one without that record and of more than `READ_AT_START` tokens is not read at start
(every rank would read it whole, on a shared filesystem): the prepare refused chat data with
nothing counted when it wrote the file, and the line is left out.
"""

from __future__ import annotations

import numpy as np

from dsnd.data.corpus import Corpus
from dsnd.data.sampler import SampleSet
from dsnd.errors import UserError

_CHUNK = 1 << 24  # tokens of the mask read at once
READ_AT_START = 1 << 30  # tokens of a memory-mapped mask read at start, at most (1 GiB)
_SAMPLES = 4096  # samples whose labels are counted at once


def counted_tokens(targets: np.ndarray) -> int:
    """The tokens a mask (bool, or uint8: nonzero counts) marks as counted."""
    return sum(
        int(np.count_nonzero(targets[i : i + _CHUNK])) for i in range(0, len(targets), _CHUNK)
    )


def _any_label(samples: SampleSet) -> bool:
    for lo in range(0, len(samples), _SAMPLES):
        if samples.label_counts(np.arange(lo, min(lo + _SAMPLES, len(samples)))).any():
            return True
    return False


def counted_line(corpus: Corpus, samples: SampleSet, packing: str) -> str | None:
    """The start line of a corpus with targets (None without: every token counts); UserError
    when nothing of it would count in the loss. `samples`: the ones the run trains on."""
    if corpus.targets is None:
        return None
    large = isinstance(corpus.targets, np.memmap) and len(corpus.targets) > READ_AT_START
    if large and corpus.counted is None:
        return None
    total = len(corpus.tokens)
    counted = corpus.counted if corpus.counted is not None else counted_tokens(corpus.targets)
    if not counted:
        raise UserError(
            f"data.path={corpus.name}: none of its {total:,} tokens counts in the "
            "loss (chat data: no conversation has an assistant turn); training on "
            "it would change nothing"
        )
    if not _any_label(samples):
        raise UserError(
            f"data.path={corpus.name}: none of its {counted:,} counted tokens is "
            f"the label of a training sample ({len(samples):,} samples of "
            f"model.seq_len {samples.seq_len} + 1 tokens, data.packing={packing}: "
            "a sample's first token, the tokens after the last whole sample and a "
            "document's first token are no labels); training on it would change "
            "nothing"
        )
    return (
        f"data: {counted:,} of {total:,} tokens counted in the loss ({100 * counted / total:.1f}%)"
    )
