"""The order of one epoch's samples, and the sample at any position of an endless stream of
epochs — in memory and time that do not grow with the corpus.

Up to `TABLE_SAMPLES` samples an epoch is ``np.random.default_rng([seed, epoch]).permutation(n)``
(8 bytes a sample, drawn once per epoch and cached). A corpus of more samples — a prepared token
file of hundreds of GB holds billions of tokens, and a table of its samples would be GBs on
every rank, drawn again at each epoch — is shuffled by a keyed Feistel network instead: a
bijection of the integers below the next power of four, four rounds of a 64-bit mixing function
with keys drawn from the same seed and epoch, and cycle-walking (applying it again while the
result is >= n) to stay below n. Every position's sample is computed on its own, in O(1), and an
epoch still visits every sample exactly once.

A blend (`dsnd.data.blend`) draws from several such streams; each has its own `stream` key so two
datasets of one size are not shuffled alike.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

TABLE_SAMPLES = 1 << 20  # at most 8 MB of permutation per epoch; beyond it, the Feistel network
_ROUNDS = 4
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _entropy(seed: int, epoch: int, stream: int | None) -> list[int]:
    return [seed, epoch] if stream is None else [seed, epoch, stream + 1]


@lru_cache(maxsize=8)
def epoch_permutation(
    num_samples: int, seed: int, epoch: int, stream: int | None = None
) -> np.ndarray:
    """The sample order of one epoch of at most `TABLE_SAMPLES` samples. Cached (a pure
    function) so consecutive steps within an epoch do not redraw it; read-only so no caller can
    corrupt the cache."""
    perm = np.random.default_rng(_entropy(seed, epoch, stream)).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def feistel(num_samples: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The images of `positions` (each < `num_samples`) under the keyed permutation of
    ``range(num_samples)`` (int64)."""
    half = max(1, (int(num_samples - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    out = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    while todo.any():  # cycle-walking: at most a few rounds, the domain is < 4 * num_samples
        x = out[todo]
        left, right = x >> shift, x & low
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & low)
        out[todo] = (left << shift) | right
        todo = out >= np.uint64(num_samples)
    return out.astype(np.int64)


def _mix(z: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (multiply-xorshift): every input bit changes about half the output."""
    z = (z + _MIX[0]) * _MIX[1]
    z = (z ^ (z >> np.uint64(29))) * _MIX[2]
    return z ^ (z >> np.uint64(32))


def _keys(seed: int, epoch: int, stream: int | None) -> np.ndarray:
    rng = np.random.default_rng(_entropy(seed, epoch, stream))
    return rng.integers(0, 2**64 - 1, size=_ROUNDS, dtype=np.uint64, endpoint=True)


def epoch_samples(
    num_samples: int, seed: int, epoch: int, positions: np.ndarray, stream: int | None = None
) -> np.ndarray:
    """The samples at `positions` (each < `num_samples`) of epoch `epoch`'s order."""
    if num_samples <= TABLE_SAMPLES:
        return epoch_permutation(num_samples, seed, epoch, stream)[positions]
    return feistel(num_samples, _keys(seed, epoch, stream), positions)


def stream_samples(
    num_samples: int, seed: int, draws: np.ndarray, stream: int | None = None
) -> np.ndarray:
    """The samples (int64) at positions `draws` of the endless stream of epochs: draw k is
    position ``k % num_samples`` of epoch ``k // num_samples``."""
    draws = np.asarray(draws, dtype=np.int64)
    epochs, positions = np.divmod(draws, num_samples)
    out = np.empty(len(draws), dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        mine = epochs == epoch
        out[mine] = epoch_samples(num_samples, seed, epoch, positions[mine], stream)
    return out
