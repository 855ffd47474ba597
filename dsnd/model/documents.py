"""Document packing (`data.packing: documents`): several documents in one sample, each seen as
if alone — positions restart at 0 where a document starts, and a token attends only to the
tokens of its own document before it (a block-diagonal causal mask).

The layers take one tensor (`forward(hidden) -> hidden`, as pipeline layers do), so the
micro-batch's document ids reach them through one `Documents` object that every layer of a
stage shares: the executor points it at micro-batch m before m's forward and again before its
backward (activation checkpointing recomputes the forward there). The mask goes to
`transformers`' own attention as an explicit boolean mask (True: attend), which SDPA takes
instead of its causal flag.

Positions and mask are built once per micro-batch on the layers' device (every layer of the
stage, and the backward's recompute, reuse them): built on the CPU they were copied to the GPU
in every layer.
"""

from __future__ import annotations

import torch


class Documents:
    """The document index of each token of the micro-batch being computed: (batch, seq) int64,
    or None (one stream: positions 0..seq-1, causal attention over the whole sample)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self._derived: dict[tuple[str, torch.device], torch.Tensor] = {}

    def use(self, ids: torch.Tensor | None) -> None:
        if ids is not self.ids:
            self.ids, self._derived = ids, {}

    def positions(self, device: torch.device) -> torch.Tensor:
        """(batch, seq) position ids: each token's distance from the start of its document
        within the sample (a document cut by the sample's start begins at 0 here too)."""
        key = ("positions", torch.device(device))
        if key not in self._derived:
            ids = self.ids.to(device)
            index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
            self._derived[key] = index - first
        return self._derived[key]

    def mask(self, device: torch.device) -> torch.Tensor:
        """(batch, 1, seq, seq) bool: query i may attend key j iff j <= i in i's document."""
        key = ("mask", torch.device(device))
        if key not in self._derived:
            ids = self.ids.to(device)
            seq = ids.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
            self._derived[key] = ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)
        return self._derived[key]


def active(documents: Documents | None) -> bool:
    """Whether `documents` holds a micro-batch's document ids."""
    return documents is not None and documents.ids is not None
