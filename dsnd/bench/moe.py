"""``dsnd bench moe``'s first part: the expert computation of one MoE layer, grouped against a
loop (its second, expert parallelism on 4 ranks: `dsnd.bench.ep_rank`, `dsnd.bench.ep_results`).

`transformers`' experts module computes a layer's experts either as one grouped matrix multiply
over all of them (`grouped_mm`, what dsnd's MoE blocks run: `config._experts_implementation`) or
as a Python loop over the experts that received tokens (`eager`). Here both run on the same
weights and tokens of a Mixtral-shaped layer with 8 local experts (what a rank holds at, say,
64 experts over ep=8), forward and backward, in alternating repetitions in this process (on
the GPU when there is one, else on the CPU with one thread, like a rank); the row is the loop's
median time over the grouped one's (target >= 1.5), void unless both give the same outputs and
gradients (1e-5, fp32).
"""

from __future__ import annotations

import argparse
import time

import torch

from dsnd.bench.rows import Row, Target, median

BENCH = "moe"
TOKENS, HIDDEN, WIDTH, EXPERTS, TOP_K = 4096, 256, 512, 8, 2
GROUPED_TARGET = 1.5


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _experts(implementation: str) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=WIDTH,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    return experts.to(_device())


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    scores = torch.randn(TOKENS, EXPERTS, generator=gen).softmax(-1)
    weights, index = scores.topk(TOP_K, dim=-1)
    device = _device()
    return hidden.to(device), index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def _step(experts: torch.nn.Module, inputs) -> tuple[float, list[torch.Tensor]]:
    hidden, index, weights = inputs
    x = hidden.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    _sync()
    start = time.perf_counter()
    out = experts(x, index, weights)
    out.square().sum().backward()
    _sync()
    seconds = time.perf_counter() - start
    return seconds, [out.detach(), x.grad, *(p.grad for p in experts.parameters())]


def grouped_rows(args: argparse.Namespace) -> list[Row]:
    """The grouped matmul against the loop, here in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grouped = _experts("grouped_mm")
        loop = _experts("eager")
        loop.load_state_dict(grouped.state_dict())
        inputs = _inputs()
        times: dict[str, list[float]] = {"grouped": [], "loop": []}
        for rep in range(args.warmup + args.steps):
            for name, experts in (("grouped", grouped), ("loop", loop)):
                seconds, found = _step(experts, inputs)
                if rep >= args.warmup:
                    times[name].append(seconds)
                if name == "grouped":
                    want = found
            worst = max(
                ((a - b).abs().max() / (1 + b.abs().max())).item()
                for a, b in zip(found, want, strict=True)
            )
    finally:
        torch.set_num_threads(threads)
    if worst > 1e-5:
        raise RuntimeError(f"the grouped and looped experts differ by {worst:.2e}: no comparison")
    ratio = median(times["loop"]) / median(times["grouped"])
    shape = (
        f"{TOKENS} tokens x top-{TOP_K} over {EXPERTS} experts, {HIDDEN} -> {WIDTH}, "
        f"on the {_device().type}"
    )
    return [
        Row(
            "grouped_mm_speedup_8_experts",
            ratio,
            Target.at_least(GROUPED_TARGET),
            f"per-expert loop / grouped matmul, forward + backward, {shape}; medians of "
            f"{args.steps}; outputs and gradients agree to {worst:.1e}",
            BENCH,
        ),
        Row("grouped_ms", 1000 * median(times["grouped"]), None, "", BENCH),
    ]
