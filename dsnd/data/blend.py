"""Blended corpora (`data.blend`): several token files trained on together, each by its weight,
as Megatron's ``--data-path 0.3 A 0.7 B``.

Which file position p of the sample stream draws from is a fixed schedule of the weights, with
a period of `PERIOD` positions: file d takes ``q_d`` of them (its weight in whole slots, largest
remainders rounding) at the slots where ``(2k + 1) / (2 q_d)`` (k = 0 .. q_d - 1) falls in the
merged ascending order, ties to the earlier file — Sainte-Laguë's order, which keeps each
file's count in every prefix of the stream near ``prefix x q_d / PERIOD``: within one sample for
two files, within 2.5 for up to 16 (tests/unit/test_blend.py; Megatron's blendable index keeps
its counts close to the weights greedily, which needs the whole prefix). So draw number
``k`` of file d at position p is ``(p // PERIOD) * q_d + (its rank among d's slots of the
period)``, computed for any p in O(1) from two tables of `PERIOD` entries, and file d's sample is
draw k of its own stream of shuffled epochs (`dsnd.data.shuffle.stream_samples`, with the blend
index of d as its stream key). The global batch of step s is therefore a function of
(train.seed, s) alone, as for one corpus: any layout and any resume see the same samples.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsnd.data.corpus import Corpus
from dsnd.data.sampler import Samples
from dsnd.data.shuffle import stream_samples

PERIOD = 1 << 16  # slots of one period of the schedule: weights resolve to 1/65536


def quotas(weights: Sequence[float]) -> np.ndarray:
    """Each weight's slots of a period (int64, summing to `PERIOD`): ``PERIOD x`` its share,
    rounded down, and the remaining slots to the largest remainders (ties to the earlier)."""
    share = np.asarray(weights, dtype=np.float64)
    exact = share / share.sum() * PERIOD
    whole = np.floor(exact).astype(np.int64)
    left = PERIOD - int(whole.sum())
    whole[np.argsort(-(exact - whole), kind="stable")[:left]] += 1
    return whole


@dataclass(frozen=True)
class Schedule:
    """Which file each position of the sample stream draws from, and its draw number there."""

    quotas: np.ndarray  # slots of each file per period
    which: np.ndarray  # the file of each slot of a period
    rank: np.ndarray  # how many earlier slots of the period are that file's

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file, draw number within that file's stream) of each stream position (int64)."""
        period, slot = np.divmod(np.asarray(positions, dtype=np.int64), PERIOD)
        which = self.which[slot]
        return which, period * self.quotas[which] + self.rank[slot]


def schedule(weights: Sequence[float]) -> Schedule:
    """The schedule of `weights` (each > 0 and worth at least one slot; `quotas`)."""
    q = quotas(weights)
    if (q < 1).any():
        raise ValueError(f"weights {list(weights)} give a file no slot of {PERIOD}")
    # (2k+1)/(2q) has a denominator <= 2^17: float64 orders every pair exactly, ties are equal
    keys = np.concatenate([(2 * np.arange(n) + 1) / (2.0 * n) for n in q.tolist()])
    order = np.argsort(keys, kind="stable")  # stable: a tie goes to the earlier file
    which = np.repeat(np.arange(len(q)), q)[order]
    rank = np.concatenate([np.arange(n) for n in q.tolist()])[order]
    return Schedule(q, which, rank.astype(np.int64))


class BlendedSamples:
    """The samples of several sample sets drawn by weight (module docstring). Sample ids are
    global: part d's sample i is ``offset_d + i``."""

    def __init__(self, parts: Sequence[Samples], weights: Sequence[float], name: str) -> None:
        self.parts = tuple(parts)
        self.schedule = schedule(weights)
        self.seq_len, self.name = self.parts[0].seq_len, name
        self._offsets = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)

    @property
    def masked(self) -> bool:
        return any(p.masked for p in self.parts)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def step_indices(self, global_batch: int, seed: int, step: int) -> np.ndarray:
        """The global sample ids of global batch `step`: positions ``[step*B, (step+1)*B)``."""
        if global_batch < 1 or step < 0 or seed < 0:
            raise ValueError(
                f"need global_batch >= 1, step >= 0, seed >= 0, got {global_batch}, {step}, {seed}"
            )
        positions = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
        which, draw = self.schedule.draws(positions)
        out = np.empty(global_batch, dtype=np.int64)
        for d in np.unique(which).tolist():
            mine = which == d
            local = stream_samples(len(self.parts[d]), seed, draw[mine], stream=d)
            out[mine] = self._offsets[d] + local
        return out

    def _split(self, indices: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(part, which rows of `indices` are its, its own sample ids) for each part present."""
        indices = np.asarray(indices, dtype=np.int64)
        part = np.searchsorted(self._offsets, indices, side="right") - 1
        return [
            (d, part == d, indices[part == d] - self._offsets[d]) for d in np.unique(part).tolist()
        ]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # on the host, as every part's batch: the runner moves the micro-batches to the device
        x = torch.empty((len(indices), self.seq_len), dtype=torch.int64, device="cpu")
        y = torch.empty_like(x)
        for d, rows, local in self._split(indices):
            rows_t = torch.from_numpy(rows)
            x[rows_t], y[rows_t] = self.parts[d].batch(local)
        return x, y

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty(len(indices), dtype=np.int64)
        for d, rows, local in self._split(indices):
            out[rows] = self.parts[d].label_counts(local)
        return out

    def document_ids(self, indices: np.ndarray) -> torch.Tensor | None:
        """As `SampleSet.document_ids`: None unless every part keeps documents apart."""
        out = torch.empty((len(indices), self.seq_len), dtype=torch.int64, device="cpu")
        for d, rows, local in self._split(indices):
            ids = self.parts[d].document_ids(local)
            if ids is None:
                return None
            out[torch.from_numpy(rows)] = ids
        return out


@dataclass
class BlendedCorpus:
    """The corpora of a blend (each a token file) and their normalised weights."""

    parts: tuple[Corpus, ...]
    weights: tuple[float, ...]

    @property
    def name(self) -> str:
        pairs = zip(self.parts, self.weights, strict=True)
        return "blend of " + ", ".join(f"{p.name} ({w:.4g})" for p, w in pairs)

    @property
    def vocab_size(self) -> int | None:
        return self.parts[0].vocab_size

    @property
    def tokenizer(self) -> str:
        return self.parts[0].tokenizer

    @property
    def targets(self) -> None:
        """No one mask: each file's own is applied to its samples (and not summed at start)."""
        return None

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(n for p in self.parts for n in p.notes)

    def files(self) -> list[dict]:
        """Path, weight, tokens and fingerprint of each file: what a checkpoint records."""
        return [
            {"path": p.name, "weight": w, "tokens": int(len(p.tokens)), "sha256": p.fingerprint}
            for p, w in zip(self.parts, self.weights, strict=True)
        ]

    @property
    def fingerprint(self) -> str:
        """sha256 of the files' paths, weights and fingerprints: another blend, another one."""
        text = json.dumps([[f["path"], f["weight"], f["sha256"]] for f in self.files()])
        return hashlib.sha256(text.encode()).hexdigest()

    def manifest(self) -> dict:
        return {
            "name": self.name,
            "tokens": sum(int(len(p.tokens)) for p in self.parts),
            "sha256": self.fingerprint,
            "blend": self.files(),
        }


def normalised(weights: Sequence[float]) -> tuple[float, ...]:
    total = math.fsum(weights)
    return tuple(w / total for w in weights)
