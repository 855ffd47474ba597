"""Document packing in the model (`dsnd.model.documents`): a sample of several documents gives
each document exactly the logits it gets alone — positions restart, attention stays inside."""

from __future__ import annotations

import pytest
import torch

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError
from dsnd.model import build_model
from dsnd.model.documents import Documents
from tests.models import spec_of

DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 6, 6, 6, 7, 7, 7]])


def test_positions_and_mask():
    docs = Documents()
    docs.use(DOCS)
    assert docs.positions(torch.device("cpu")).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2],
    ]
    mask = docs.mask(torch.device("cpu"))
    assert mask.shape == (2, 1, 12, 12) and mask.dtype == torch.bool
    assert mask[0, 0, 4].tolist() == [False] * 3 + [True] * 2 + [False] * 7  # own doc, causal


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_packed_documents_get_the_logits_they_get_alone(preset):
    spec = spec_of(preset)
    docs = Documents()
    model = build_model(spec, 7, docs).eval()
    x = torch.randint(0, spec.vocab_size, DOCS.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        docs.use(DOCS)
        packed = model(x)
        docs.use(None)
        streamed = model(x)
        for row in range(2):
            for d in DOCS[row].unique():
                where = DOCS[row] == d
                alone = model(x[row, where].unsqueeze(0))[0]
                torch.testing.assert_close(packed[row, where], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed, streamed, atol=1e-3)  # the stream attends across them


def test_packing_is_refused_with_context_parallelism():
    with pytest.raises(UserError) as e:
        resolve(load(None, ["data.packing=documents", "parallel.cp=2"]), 2)
    assert str(e.value) == (
        "data.packing=documents: not with parallel.cp=2 (context parallel "
        "attention takes no document mask); use parallel.cp: 1"
    )
    assert resolve(load(None, ["data.packing=documents"]), 1).run.data.packing == "documents"
