"""Which samples train at which step — a function of (seed, global step) only.

This is the base of every parity test: a run at dp=4, micro=1 must see exactly the samples a
dp=1, micro=16 run sees at the same step, in the same global order, so that losses and gradients
can be compared across layouts and a checkpoint can resume on another layout without storing a
data position (the step counter is the data position).

The stream of samples is an endless sequence of epochs; epoch ``e`` is a permutation of all
sample indices drawn from ``np.random.default_rng([seed, e])`` (PCG64). Global batch ``s`` is
positions ``[s*B, (s+1)*B)`` of that stream, so a batch that crosses an epoch boundary simply
continues into the next epoch's permutation, and B may exceed the number of samples. Only then
is the batch split: rank r of dp takes the r-th contiguous slice, cut into micro-batches.
Concatenating rank 0's micro-batches, then rank 1's, ... gives the global batch in order.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from dsnd.errors import UserError

IGNORE_INDEX = -100  # a label that does not count (Hugging Face's and torch's ignore index)


class SampleSet:
    """Non-overlapping windows of ``seq_len + 1`` tokens; sample i is (window[:-1], window[1:]).

    Windows do not overlap so each token is a prediction target at most once per epoch; the
    trailing tokens that do not fill a window are dropped. A label is -100 (not counted) where
    `targets` (one bool per token) says its token is no target, and, given `documents` (the
    document index of each token: document packing), where it would predict the first token of
    the next document from the end of the previous one.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "corpus",
                 targets: np.ndarray | None = None,
                 documents: np.ndarray | None = None) -> None:  # fmt: skip
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
        self.seq_len = seq_len
        self.name = name
        # A (count, seq_len + 1) view: gathering a batch is one fancy-index, no per-sample loop.
        self._windows = tokens[: count * window].reshape(count, window)
        cut = [None if a is None else np.asarray(a)[: count * window].reshape(count, window)
               for a in (targets, documents)]  # fmt: skip
        self._targets, self._documents = cut

    @property
    def masked(self) -> bool:
        """Whether some labels may not count or documents are kept apart (else every label of
        every sample counts and attention runs across the whole sample)."""
        return self._targets is not None or self._documents is not None

    def __len__(self) -> int:
        return self._windows.shape[0]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i as int64 tensors x, y of shape (seq_len,)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        x, y = self.batch(np.array([i]))
        return x[0], y[0]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `indices` stacked to int64 tensors x, y of shape (len(indices), seq_len)."""
        indices = np.asarray(indices, dtype=np.int64)
        windows = torch.from_numpy(self._windows[indices].astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.masked:
            y[~torch.from_numpy(self._counted(indices))] = IGNORE_INDEX
        return x, y

    def _counted(self, indices: np.ndarray) -> np.ndarray:
        """(n, seq_len) bool: which labels of samples `indices` count."""
        keep = np.ones((len(indices), self.seq_len), dtype=bool)
        if self._targets is not None:
            keep &= self._targets[indices][:, 1:]
        if self._documents is not None:
            docs = self._documents[indices]
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
        if self._documents is None:
            return None
        docs = self._documents[np.asarray(indices, dtype=np.int64)][:, :-1]
        return torch.from_numpy(docs.astype(np.int64))


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch. Cached (a pure function) so consecutive steps within an
    epoch do not redraw it; read-only so no caller can corrupt the cache."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def global_batch_indices(num_samples: int, global_batch: int, seed: int, step: int) -> np.ndarray:
    """Sample indices (int64, length `global_batch`) of global batch `step` (0-based).

    Stateless: computed from the arguments alone, without replaying earlier steps. The work is
    O(global_batch) plus one permutation per epoch touched (memoised across calls).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {global_batch}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    start = step * global_batch
    end = start + global_batch
    pieces = []
    for epoch in range(start // num_samples, (end - 1) // num_samples + 1):
        epoch_start = epoch * num_samples
        lo = max(start, epoch_start) - epoch_start
        hi = min(end, epoch_start + num_samples) - epoch_start
        pieces.append(_epoch_permutation(num_samples, seed, epoch)[lo:hi])
    return np.concatenate(pieces).astype(np.int64)


def micro_batches(
    samples: SampleSet, indices: np.ndarray, dp_rank: int, dp: int, micro: int
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
    samples: SampleSet, seed: int, step: int, global_batch: int, dp_rank: int, dp: int, micro: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `dp_rank`'s micro-batches for global step `step`."""
    indices = global_batch_indices(len(samples), global_batch, seed, step)
    return micro_batches(samples, indices, dp_rank, dp, micro)
