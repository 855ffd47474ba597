"""Which samples train at which step — a function of (seed, global step) only.

This is the base of every parity test: a run at dp=4, micro=1 must see exactly the samples a
dp=1, micro=16 run sees at the same step, in the same global order, so that losses and gradients
can be compared across layouts and a checkpoint can resume on another layout without storing a
data position (the step counter is the data position).

The stream of samples is an endless sequence of epochs; epoch ``e`` is a permutation of all
sample indices drawn from ``np.random.default_rng([seed, e])`` (PCG64; a keyed Feistel network
past a million samples, `dsnd.data.shuffle`, so that no table of every sample is ever built).
Global batch ``s`` is positions ``[s*B, (s+1)*B)`` of that stream, so a batch that crosses an
epoch boundary simply continues into the next epoch's permutation, and B may exceed the number
of samples (a blend of corpora, `dsnd.data.blend`, draws each position from one of several such
streams by a fixed schedule of its weights). Only then is the batch split: rank r of dp takes
the r-th contiguous slice, cut into micro-batches. Concatenating rank 0's micro-batches, then
rank 1's, ... gives the global batch in order.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from dsnd.data.doc_starts import DocumentStarts
from dsnd.data.shuffle import stream_samples
from dsnd.errors import UserError

IGNORE_INDEX = -100  # a label that does not count (Hugging Face's and torch's ignore index)


class Samples(Protocol):
    """What training reads samples through: a `SampleSet`, or a blend of several
    (`dsnd.data.blend.BlendedSamples`) whose order of global batches is its own."""

    seq_len: int
    name: str

    @property
    def masked(self) -> bool: ...

    def __len__(self) -> int: ...

    def step_indices(self, global_batch: int, seed: int, step: int) -> np.ndarray: ...

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...

    def label_counts(self, indices: np.ndarray) -> np.ndarray: ...

    def document_ids(self, indices: np.ndarray) -> torch.Tensor | None: ...


class SampleSet:
    """Non-overlapping windows of ``seq_len + 1`` tokens; sample i is (window[:-1], window[1:]).

    Windows do not overlap so each token is a prediction target at most once per epoch; the
    trailing tokens that do not fill a window are dropped. A label is -100 (not counted) where
    `targets` (one flag per token) says its token is no target, and, given `documents` (the
    document index of each token, or a token file's `DocumentStarts`: document packing), where
    it would predict the first token of the next document from the end of the previous one.

    Nothing here reads the whole corpus: a memory-mapped token file stays mapped (the windows
    are a reshaped view) and a batch reads its own windows only. With `vocab_size` (a token
    file's sidecar) each gathered batch's ids are checked against it, so a file whose sidecar
    lies fails with its name rather than as an index error inside the model.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        name: str = "corpus",
        targets: np.ndarray | None = None,
        documents: np.ndarray | DocumentStarts | None = None,
        vocab_size: int | None = None,
    ) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}")
        window = seq_len + 1
        count = len(tokens) // window
        if count < 1:
            raise UserError(
                f"{name} has {len(tokens)} tokens, fewer than the {window} (seq_len {seq_len} + 1) "
                f"needed for one sample; use a larger corpus or a smaller seq_len"
            )
        self.seq_len, self.name, self.vocab_size = seq_len, name, vocab_size
        # A (count, seq_len + 1) view: gathering a batch is one fancy-index, no per-sample loop.
        self._windows = tokens[: count * window].reshape(count, window)
        self._starts = documents if isinstance(documents, DocumentStarts) else None
        cut = [
            None if a is None else np.asarray(a)[: count * window].reshape(count, window)
            for a in (targets, None if self._starts else documents)
        ]
        self._targets, self._documents = cut

    @property
    def masked(self) -> bool:
        """Whether some labels may not count or documents are kept apart (else every label of
        every sample counts and attention runs across the whole sample)."""
        return self._targets is not None or self._has_documents

    @property
    def _has_documents(self) -> bool:
        return self._documents is not None or self._starts is not None

    def __len__(self) -> int:
        return self._windows.shape[0]

    def step_indices(self, global_batch: int, seed: int, step: int) -> np.ndarray:
        """The samples of global batch `step` (`global_batch_indices`)."""
        return global_batch_indices(len(self), global_batch, seed, step)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i as int64 tensors x, y of shape (seq_len,)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        x, y = self.batch(np.array([i]))
        return x[0], y[0]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `indices` stacked to int64 tensors x, y of shape (len(indices), seq_len)."""
        indices = np.asarray(indices, dtype=np.int64)
        rows = self._windows[indices].astype(np.int64)
        if self.vocab_size is not None and len(rows):
            self._check_ids(rows, indices)
        # two copies: for one sample both slices are already "contiguous" views of one row, and
        # masking a label would write -100 into the next input too
        x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
        if self.masked:
            y[~torch.from_numpy(self._counted(indices))] = IGNORE_INDEX
        return x, y

    def _check_ids(self, rows: np.ndarray, indices: np.ndarray) -> None:
        bad = (rows < 0) | (rows >= self.vocab_size)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise UserError(
                f"{self.name}: sample {int(indices[r])} holds token id "
                f"{int(rows[r, c])}, outside the vocabulary of {self.vocab_size} "
                "its sidecar records; the metadata does not describe these "
                "tokens"
            )

    def _window_documents(self, indices: np.ndarray) -> np.ndarray:
        """(n, seq_len + 1): the document of each token of samples `indices`."""
        if self._starts is not None:
            return self._starts.window_ids(indices * (self.seq_len + 1), self.seq_len + 1)
        return self._documents[indices]

    def _counted(self, indices: np.ndarray) -> np.ndarray:
        """(n, seq_len) bool: which labels of samples `indices` count."""
        keep = np.ones((len(indices), self.seq_len), dtype=bool)
        if self._targets is not None:
            keep &= self._targets[indices][:, 1:] != 0
        if self._has_documents:
            docs = self._window_documents(indices)
            keep &= docs[:, 1:] == docs[:, :-1]
        return keep

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        """How many labels of each sample of `indices` count (int64, one per sample)."""
        indices = np.asarray(indices, dtype=np.int64)
        if not self.masked:
            return np.full(len(indices), self.seq_len, dtype=np.int64)
        return self._counted(indices).sum(axis=1, dtype=np.int64)

    def document_ids(self, indices: np.ndarray) -> torch.Tensor | None:
        """(n, seq_len) int64: the document each input token of samples `indices` belongs to
        (None without document packing)."""
        if not self._has_documents:
            return None
        docs = self._window_documents(np.asarray(indices, dtype=np.int64))[:, :-1]
        return torch.from_numpy(docs.astype(np.int64))


def global_batch_indices(num_samples: int, global_batch: int, seed: int, step: int) -> np.ndarray:
    """Sample indices (int64, length `global_batch`) of global batch `step` (0-based).

    Stateless: computed from the arguments alone, without replaying earlier steps. The work is
    O(global_batch) plus, for corpora of up to `dsnd.data.shuffle.TABLE_SAMPLES` samples, one
    permutation per epoch touched (memoised across calls).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {global_batch}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    draws = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return stream_samples(num_samples, seed, draws)


def micro_batches(
    samples: Samples, indices: np.ndarray, dp_rank: int, dp: int, micro: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `dp_rank`'s share of a global batch, as micro-batches of `micro` samples.

    The rank takes the contiguous slice ``indices[dp_rank*n:(dp_rank+1)*n]`` with
    ``n = len(indices) // dp``; each micro-batch is (x, y), both int64 of shape (micro, seq_len).
    Raises ValueError when the global batch does not split evenly (the config loader checks the
    batch math with a user-facing message before any process starts).
    """
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"need 0 <= dp_rank < dp, got dp_rank {dp_rank} dp {dp}")
    if micro < 1:
        raise ValueError(f"micro must be at least 1, got {micro}")
    total = len(indices)
    if total % dp:
        raise ValueError(f"global batch {total} is not divisible by dp {dp}")
    n = total // dp
    if n % micro:
        raise ValueError(
            f"per-rank batch {n} (global batch {total} / dp {dp}) is not divisible "
            f"by micro-batch size {micro}"
        )
    mine = np.asarray(indices)[dp_rank * n : (dp_rank + 1) * n]
    return [samples.batch(mine[k : k + micro]) for k in range(0, n, micro)]


def batch_for_step(
    samples: Samples, seed: int, step: int, global_batch: int, dp_rank: int, dp: int, micro: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `dp_rank`'s micro-batches for global step `step`."""
    indices = samples.step_indices(global_batch, seed, step)
    return micro_batches(samples, indices, dp_rank, dp, micro)
