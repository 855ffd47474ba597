"""Rank program: a MoE block's experts split over an expert-parallel group (ep = world) against
the whole block in one process.

Usage (every rank): python tests/distributed/ep_worker.py OUT.json
Every rank builds the same seeded MoE block of each family (Mixtral: top-2 of 4 renormalised;
Qwen3-MoE: top-2 of 8; Qwen2-MoE: top-4 of 8 with a shared expert) and its own tokens; the
reference runs the whole block on every rank's tokens at once. With the experts split
(`dsnd.moe`), each rank records the largest differences of its output, its input gradient, its
local experts' gradients (every rank's tokens' contributions) and its router gradient (its own
tokens' share, summed over the group) against the reference, each relative to the reference's
largest magnitude (1 + max |ref|), and how many experts it computes and holds.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from dsnd.moe import ExpertParallel, parallelize_experts  # noqa: E402
from tests.distributed.worker import everyone, this_rank, world, write_json  # noqa: E402
from tests.models import spec_of  # noqa: E402

SPECS = {
    "mixtral": spec_of("mixtral-tiny"),
    "qwen3_moe": spec_of("qwen3-moe-tiny"),
    "qwen2_moe": spec_of(
        "qwen1.5-moe-a2.7b",
        {"moe_intermediate_size": 32, "num_experts": 8, "shared_expert_intermediate_size": 48},
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        ffn_size=96,
        vocab_size=256,
    ),
}


def _block(spec, layer: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    block = spec.family.block(spec.config, layer)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    return block


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / (1 + want.abs().max())).item()


def _case(spec, ep: ExpertParallel, world_size: int) -> dict:
    # uneven token counts per rank
    tokens = [
        torch.randn(2, 5 + 3 * r, spec.hidden_size, generator=torch.Generator().manual_seed(r))
        for r in range(world_size)
    ]
    weights = [
        torch.randn(t.shape, generator=torch.Generator().manual_seed(100 + r))
        for r, t in enumerate(tokens)
    ]
    ref = _block(spec).mlp
    ref_in = [t.clone().requires_grad_() for t in tokens]
    loss = sum((ref(x) * w).sum() for x, w in zip(ref_in, weights, strict=True))
    loss.backward()

    block = _block(spec)
    assert parallelize_experts(block, ep)
    moe = block.mlp
    mine = tokens[ep.rank].clone().requires_grad_()
    out = moe(mine)
    (out * weights[ep.rank]).sum().backward()
    with torch.no_grad():
        want = ref(tokens[ep.rank])
    span = ep.local_range(moe.experts.num_experts)
    found = {
        "out": _diff(out, want),
        "x_grad": _diff(mine.grad, ref_in[ep.rank].grad),
        "local_experts": len(span),
    }
    for name in ("gate_up_proj", "down_proj"):
        got = getattr(moe.experts, name).grad  # this rank's experts only
        found[name] = _diff(got, getattr(ref.experts, name).grad[span.start : span.stop])
        found[f"{name}_held"] = got.shape[0]  # of the layer's experts
    router = moe.gate.weight.grad.clone()
    dist.all_reduce(router, group=ep.group)
    found["router"] = _diff(router, ref.gate.weight.grad)
    found["router_grad_max"] = ref.gate.weight.grad.abs().max().item()  # not a zero compared
    return found


def main() -> None:
    info = this_rank()
    with world(info, timeout_s=120, plain=True):
        everyone_group = dist.new_group(list(range(info.world_size)))
        alone = [dist.new_group([r]) for r in range(info.world_size)]  # each rank its experts
        ep = ExpertParallel(everyone_group, alone[info.rank])
        mine = {name: _case(spec, ep, info.world_size) for name, spec in SPECS.items()}
        write_json(sys.argv[1], everyone(mine), info.rank)


if __name__ == "__main__":
    main()
