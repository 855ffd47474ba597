"""Rank program: dsnd's tensor-parallel layers against single-process torch.nn references.

Usage (every rank): python tests/distributed/tp_worker.py OUT.json
tp = world size. Every case builds the torch.nn reference from seeded full weights (identical on
every rank), builds the tensor-parallel layer from the same full weights via `load_full`, runs
forward and backward on identical inputs, and records the largest absolute differences of
outputs, input gradients and this rank's parameter-gradient slices against the matching slices
of the reference, plus the collectives issued during forward and during backward. Rank 0 gathers
every rank's findings and writes {case: [finding per rank]}.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dsnd.distributed.groups import build_groups  # noqa: E402
from dsnd.model import LayerStack, layer_specs  # noqa: E402
from dsnd.topology import Topology  # noqa: E402
from dsnd.tp import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_partial_grads,
    vocab_parallel_cross_entropy,
)
from dsnd.tp.context import TensorParallel  # noqa: E402
from tests.distributed.worker import everyone, this_rank, world, write_json  # noqa: E402
from tests.models import spec_of  # noqa: E402

COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather")
VOCAB = 249  # divisible by neither 2 nor 4: padded to 250 at tp=2, 252 at tp=4
BATCH, SEQ, HIDDEN, FFN = 2, 8, 8, 16


class Collectives:
    """Counts calls of the torch.distributed collectives (looked up by the mappings per call)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._saved: dict = {}

    def __enter__(self) -> Collectives:
        for name in COUNTED:
            real = getattr(dist, name)
            self._saved[name] = real

            def counted(*args, _name=name, _real=real, **kwargs):
                self.calls[_name] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def take(self) -> dict[str, int]:
        """The calls since the last take."""
        calls, self.calls = dict(self.calls), Counter()
        return calls


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def my_slice(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    return full.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)]


def gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def run_counted(layer, x: torch.Tensor, probe: torch.Tensor):
    """`layer(x)` and the backward of (out * probe).sum(), counting each one's collectives."""
    with Collectives() as calls:
        out = layer(x)
        forward = calls.take()
        (out * probe).sum().backward()
        backward = calls.take()
    return out, forward, backward


def mlp_case(group, sequence_parallel: bool, gather_output: bool = False) -> dict:
    """fc2(gelu(fc1(x))) against Row(gelu(Column(x)))."""
    w1, b1 = seeded(1, FFN, HIDDEN), seeded(2, FFN)
    w2, b2 = seeded(3, HIDDEN, FFN), seeded(4, HIDDEN)
    x, probe = seeded(5, BATCH, SEQ, HIDDEN), seeded(6, BATCH, SEQ, HIDDEN)

    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    with torch.no_grad():
        fc1.weight.copy_(w1), fc1.bias.copy_(b1), fc2.weight.copy_(w2), fc2.bias.copy_(b2)
    x_ref = x.clone().requires_grad_()
    y_ref = fc2(F.gelu(fc1(x_ref)))
    (y_ref * probe).sum().backward()

    col = ColumnParallelLinear(
        HIDDEN, FFN, group, gather_output=gather_output, sequence_parallel=sequence_parallel
    )
    row = RowParallelLinear(
        FFN, HIDDEN, group, input_is_parallel=not gather_output, sequence_parallel=sequence_parallel
    )
    col.load_full(w1, b1)
    row.load_full(w2, b2)
    # under sequence parallelism each rank holds its slice of the sequence, in and out
    x_tp = (my_slice(x, 1, group) if sequence_parallel else x).clone().requires_grad_()
    probe_tp = my_slice(probe, 1, group) if sequence_parallel else probe
    # the summed loss over ranks is the reference loss: replicated without SP (each rank's
    # loss is the whole loss), a partition of the tokens with SP
    y, forward, backward = run_counted(lambda t: row(F.gelu(col(t))), x_tp, probe_tp)
    bias_before = row.bias.grad.clone()
    allreduce_partial_grads(row.parameters(), group)

    y_full = gather(y, 1, group) if sequence_parallel else y
    dx = gather(x_tp.grad, 1, group) if sequence_parallel else x_tp.grad
    return {
        "forward_calls": forward,
        "backward_calls": backward,
        "out": diff(y_full, y_ref),
        "x_grad": diff(dx, x_ref.grad),
        "col_weight_grad": diff(col.weight.grad, my_slice(fc1.weight.grad, 0, group)),
        "col_bias_grad": diff(col.bias.grad, my_slice(fc1.bias.grad, 0, group)),
        "row_weight_grad": diff(row.weight.grad, my_slice(fc2.weight.grad, 1, group)),
        "row_bias_grad": diff(row.bias.grad, fc2.bias.grad),
        "row_bias_grad_before_sp_reduce": diff(bias_before, fc2.bias.grad),
        "shapes": {
            "col_weight": list(col.weight.shape),
            "row_weight": list(row.weight.shape),
            "y": list(y.shape),
        },
        "attrs": {
            "col_weight": [col.weight.tensor_model_parallel, col.weight.partition_dim],
            "col_bias": [col.bias.tensor_model_parallel, col.bias.partition_dim],
            "row_weight": [row.weight.tensor_model_parallel, row.weight.partition_dim],
            "row_bias_split": getattr(row.bias, "tensor_model_parallel", False),
            "row_bias_sp": row.bias.partial_grad,
        },
    }


def padded_rows(full: torch.Tensor, padded: int) -> torch.Tensor:
    return torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])


def embedding_case(group, sequence_parallel: bool) -> dict:
    weight = seeded(7, VOCAB, HIDDEN)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))
    tp = dist.get_world_size(group)
    local = -(-VOCAB // tp)
    # both ends of the vocabulary and both sides of every rank's slice boundary
    ids[0, :4] = torch.tensor([0, VOCAB - 1, local - 1, local])
    ids[1, :2] = torch.tensor([(tp - 1) * local - 1, (tp - 1) * local])
    probe = seeded(9, BATCH, SEQ, HIDDEN)

    ref = nn.Embedding(VOCAB, HIDDEN)
    with torch.no_grad():
        ref.weight.copy_(weight)
    out_ref = ref(ids)
    (out_ref * probe).sum().backward()

    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group, sequence_parallel=sequence_parallel)
    emb.load_full(weight)
    probe_tp = my_slice(probe, 1, group) if sequence_parallel else probe
    out, forward, backward = run_counted(emb, ids, probe_tp)
    out_full = gather(out, 1, group) if sequence_parallel else out
    grad_ref = padded_rows(ref.weight.grad, emb.padded_vocab)[emb.vocab_start : emb.vocab_end]
    return {
        "forward_calls": forward,
        "backward_calls": backward,
        "out": diff(out_full, out_ref),
        "weight_grad": diff(emb.weight.grad, grad_ref),
        "padded_vocab": emb.padded_vocab,
        "rows": [emb.vocab_start, emb.vocab_end],
        "weight_attrs": [emb.weight.tensor_model_parallel, emb.weight.partition_dim],
    }


def cross_entropy_case(group) -> dict:
    tp = dist.get_world_size(group)
    padded = -(-VOCAB // tp) * tp
    logits = 3 * seeded(10, BATCH, SEQ, VOCAB)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))
    labels[0, :3] = torch.tensor([0, VOCAB - 1, -100])
    labels[1, 5] = -100

    full = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(full.reshape(-1, VOCAB), labels.reshape(-1))
    loss_ref.backward()

    # padding columns hold large logits: counted in the softmax they would dominate the loss
    padded_logits = torch.cat([logits, logits.new_full((BATCH, SEQ, padded - VOCAB), 30.0)], -1)
    shard = my_slice(padded_logits, -1, group).clone().requires_grad_()
    with Collectives() as calls:
        loss = vocab_parallel_cross_entropy(shard, labels, group, VOCAB)
        forward = calls.take()
        loss.backward()
        backward = calls.take()
    grad_ref = torch.cat([full.grad, full.grad.new_zeros(BATCH, SEQ, padded - VOCAB)], -1)
    return {
        "forward_calls": forward,
        "backward_calls": backward,
        "loss": loss.item(),
        "loss_ref": loss_ref.item(),
        "logits_grad": diff(shard.grad, my_slice(grad_ref, -1, group)),
        "shard_width": shard.shape[-1],
    }


def block_case(group, family: str, sequence_parallel: bool) -> dict:
    """One transformer block (split by its family's TP plan) against the unsplit block, both
    initialised by dsnd from the same (seed, layer index): outputs, input and parameter
    gradients, and the collectives of forward and backward."""
    dims = spec_of(
        f"{family}-tiny",
        {"tie_word_embeddings": False},
        hidden_size=32,
        num_layers=1,
        num_heads=8,
        num_kv_heads=4 if family == "llama" else 8,
        ffn_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    tp = TensorParallel(group, sequence_parallel)
    ref = LayerStack(layer_specs(dims), seed=5, layer_indices=[1])
    block = LayerStack(layer_specs(dims, tp), seed=5, layer_indices=[1])
    x, probe = seeded(12, BATCH, SEQ, 32), seeded(13, BATCH, SEQ, 32)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * probe).sum().backward()

    x_tp = (my_slice(x, 1, group) if sequence_parallel else x).clone().requires_grad_()
    probe_tp = my_slice(probe, 1, group) if sequence_parallel else probe
    y, forward, backward = run_counted(block, x_tp, probe_tp)
    allreduce_partial_grads(block.parameters(), group)
    want = dict(ref.named_parameters())
    grads = 0.0
    for name, param in block.named_parameters():
        full = want[name].grad
        shard = getattr(param, "tp_shard", None)
        grads = max(grads, diff(param.grad, shard.take(full) if shard is not None else full))
    return {
        "forward_calls": forward,
        "backward_calls": backward,
        "out": diff(gather(y, 1, group) if sequence_parallel else y, ref(x)),
        "x_grad": diff(gather(x_tp.grad, 1, group) if sequence_parallel else x_tp.grad, x_ref.grad),
        "param_grads": grads,
        "names_equal": sorted(want) == sorted(n for n, _ in block.named_parameters()),
    }


def main(out_path: str) -> None:
    info = this_rank()
    results = {}
    with world(info, timeout_s=60):
        tp = dist.get_world_size()
        group = build_groups(Topology.from_world(tp, pp=1, tp=tp)).tensor
        cases = {
            "mlp": lambda: mlp_case(group, sequence_parallel=False),
            "mlp_sp": lambda: mlp_case(group, sequence_parallel=True),
            "mlp_gather_scatter": lambda: mlp_case(group, False, gather_output=True),
            "embedding": lambda: embedding_case(group, sequence_parallel=False),
            "embedding_sp": lambda: embedding_case(group, sequence_parallel=True),
            "cross_entropy": lambda: cross_entropy_case(group),
            "llama_block": lambda: block_case(group, "llama", sequence_parallel=False),
            "llama_block_sp": lambda: block_case(group, "llama", sequence_parallel=True),
            "gpt2_block": lambda: block_case(group, "gpt2", sequence_parallel=False),
            "gpt2_block_sp": lambda: block_case(group, "gpt2", sequence_parallel=True),
        }
        for name, run in cases.items():
            results[name] = everyone(run())
    write_json(out_path, results, info.rank)


if __name__ == "__main__":
    main(sys.argv[1])
