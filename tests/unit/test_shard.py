"""`dsnd.tp.shard.Shard`: which part of a full tensor each tensor-parallel rank holds."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsnd.tp import Shard


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_contiguous_chunks_and_back(size, dim):
    full = _full(8, 12)
    shards = [Shard(dim, r, size, full.shape[dim]).take(full) for r in range(size)]
    for r, got in enumerate(shards):
        assert torch.equal(got, full.chunk(size, dim)[r])
    assert torch.equal(Shard(dim, 0, size, full.shape[dim]).combine(shards), full)


@pytest.mark.parametrize("size", [2, 4])
def test_vocabulary_padded_with_zero_rows_that_never_come_back(size):
    full = _full(249, 3)  # 249 rows: padded to 250 (tp=2) or 252 (tp=4)
    shard0 = Shard(0, 0, size, 249)
    assert shard0.padded_len == -(-249 // size) * size
    shards = [Shard(0, r, size, 249).take(full) for r in range(size)]
    assert all(s.shape == (shard0.local_len, 3) for s in shards)
    pad = shard0.padded_len - 249
    assert torch.equal(shards[-1][shard0.local_len - pad :], torch.zeros(pad, 3))
    assert torch.equal(torch.cat(shards)[:249], full)
    assert torch.equal(shard0.combine(shards), full)


def test_stride_three_splits_q_k_v_separately():
    """GPT-2's c_attn weight (in, 3 * hidden): rank r holds [q_r | k_r | v_r]."""
    hidden = 8
    full = _full(4, 3 * hidden)
    q, k, v = full.split(hidden, dim=1)
    for r in range(2):
        got = Shard(1, r, 2, 3 * hidden, stride=3).take(full)
        want = torch.cat([q.chunk(2, 1)[r], k.chunk(2, 1)[r], v.chunk(2, 1)[r]], dim=1)
        assert torch.equal(got, want)
    shards = [Shard(1, r, 2, 3 * hidden, stride=3).take(full) for r in range(2)]
    assert torch.equal(Shard(1, 0, 2, 3 * hidden, stride=3).combine(shards), full)
    bias = _full(3 * hidden)
    shards = [Shard(0, r, 2, 3 * hidden, stride=3).take(bias) for r in range(2)]
    assert torch.equal(Shard(0, 1, 2, 3 * hidden, stride=3).combine(shards), bias)


def test_reads_only_its_shard_from_a_safetensors_slice(tmp_path):
    weights = {"w": _full(249, 4), "c": _full(4, 24)}
    save_file(weights, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        for r in range(4):
            vocab = Shard(0, r, 4, 249)
            assert torch.equal(vocab.take(f.get_slice("w")), vocab.take(weights["w"]))
        for r in range(2):
            qkv = Shard(1, r, 2, 24, stride=3)
            assert torch.equal(qkv.take(f.get_slice("c")), qkv.take(weights["c"]))


def test_full_shape_and_bad_shards():
    assert Shard(1, 0, 2, 24, stride=3).full_shape((4, 12)) == (4, 24)
    assert Shard(0, 1, 4, 249).full_shape((63, 64)) == (249, 64)
    with pytest.raises(ValueError, match="rank 2 not in a group of 2"):
        Shard(0, 2, 2, 8)
    with pytest.raises(ValueError, match="does not split into 3 parts of 2 chunks"):
        Shard(1, 0, 2, 9, stride=3)
    with pytest.raises(ValueError, match="3 shards for a group of 2"):
        Shard(0, 0, 2, 8).combine([torch.zeros(4)] * 3)
