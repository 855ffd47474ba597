"""Run one stage's share of one optimizer step: dispatch the schedule's actions, nothing more.

Per action, on a stage holding layers [a, b) of the model in one DeepSpeed engine:
  F(m): input = the micro-batch's tokens (first stage) or the activation received from the
        previous stage; output = engine(input); the last stage computes the loss, the others
        send the output on.
  B(m): the last stage backpropagates its loss (DeepSpeed scales it by 1/gas); the others
        receive d(loss)/d(output) and backpropagate the surrogate (output * grad).sum() without
        scaling again; every stage but the first sends d(loss)/d(input) back.

ZeRO 1-3: all of a step's actions run inside `engine.coalesce_grad_reduction()`, so gradients are
reduced once per step over the stage's data-parallel group; without it ZeRO-3 gives silently
wrong gradients once several forwards precede their backwards (1F1B's warm-up; measured:
2 ranks, 4 micro-batches, loss after one SGD step 1.2753 instead of the reference 1.2345).
DeepSpeed forbids `engine.step()` inside that block, so the gas `step()` calls (the optimizer
moves at the last) follow it. ZeRO-0 cannot coalesce; its engine all-reduces at the
accumulation boundary, so each backward is followed by its `step()`.

With tensor parallelism the last stage's logits are this rank's vocabulary slice and the loss is
vocab-parallel (`StageMath.loss_fn`); under sequence parallelism the replicated parameters'
partial gradients are summed over the tensor group once, after the step's last backward
(`StageMath.sync_grads`): inside the coalesced block before ZeRO reduces over data parallel, or
after ZeRO-0's data-parallel all-reduce (both are sums, so the order does not matter).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsnd.engine.build import replica_grad_norm
from dsnd.model import lm_loss
from dsnd.pipeline.p2p import StageLinks
from dsnd.pipeline.schedule import Action
from dsnd.pipeline.tied import TiedWeights


@dataclass(frozen=True)
class StageShape:
    """What flows between stages: (micro, seq, hidden) activations in `dtype`."""

    micro: int
    seq_len: int
    hidden: int
    dtype: torch.dtype

    @property
    def activation(self) -> tuple[int, int, int]:
        return (self.micro, self.seq_len, self.hidden)


@dataclass(frozen=True)
class StageMath:
    """The step's computation besides the layers: loss, gradient fix-ups, ZeRO-0's norm."""

    norm_group: dist.ProcessGroup  # one model replica: the ZeRO-0 norm sums over it
    tp_rank: int = 0
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    sync_grads: Callable[[], None] | None = None  # once, after the step's last backward


PHASES = ("forward", "backward", "comm", "optimizer", "pipeline_wait")


@dataclass
class StepResult:
    loss: torch.Tensor | None  # mean over this rank's micro-batches (last stage only)
    grad_norm: float | None  # ZeRO-0 only: DeepSpeed keeps no norm there (see zero.py)
    # seconds per phase, disjoint: forward / backward compute (ZeRO-0's data-parallel all-reduce
    # runs inside its last backward), comm (tied weights, sequence-parallel sums, ZeRO's coalesced
    # reduction, waiting for sends), optimizer (the engine's step), pipeline_wait (blocked in
    # receives: the pipeline bubble as this stage sees it)
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


@torch.no_grad()
def run_stage_eval(
    engine,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    links: StageLinks,
    shape: StageShape,
    math: StageMath,
    tied: TiedWeights | None = None,
) -> torch.Tensor | None:
    """Forward only, no gradients: the mean loss over `micro_batches` on the last stage (None on
    the others). Activations flow through the stages in micro-batch order."""
    first, last = links.prev is None, links.next is None
    engine.eval()
    if tied:
        tied.begin_step(engine.device)  # the borrower needs the current weight; none comes back
    links.begin_step(shape.activation, shape.dtype,
                     activations=0 if first else len(micro_batches), gradients=0)  # fmt: skip
    losses = []
    for x, y in micro_batches:
        x = x.to(engine.device) if first else links.recv_activation()
        out = engine(x)
        if last:
            losses.append(math.loss_fn(out, y.to(engine.device)).double())
        else:
            links.send_activation(out)
    links.wait()
    links.reset_recv_wait()
    engine.train()
    return torch.stack(losses).mean() if last else None


@contextlib.contextmanager
def _timed(times: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        times[phase] += time.perf_counter() - start


def run_stage_step(
    engine,
    actions: list[Action],
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    links: StageLinks,
    shape: StageShape,
    math: StageMath,
    tied: TiedWeights | None = None,
) -> StepResult:
    """Execute `actions` (one optimizer step of this stage); `tied` exchanges the weights this
    stage shares with another (see pipeline/tied.py)."""
    first, last = links.prev is None, links.next is None
    backwards_left = sum(a.kind == "B" for a in actions)
    grad_norm = None
    coalesce = engine.zero_optimization_stage() > 0
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    result = StepResult(loss=None, grad_norm=None)
    times = result.times
    links.reset_recv_wait()
    ctx = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
    if tied:
        with _timed(times, "comm"):
            tied.begin_step(engine.device)  # before posting receives: the weight comes first
    links.begin_step(
        shape.activation,
        shape.dtype,
        activations=0 if first else sum(a.kind == "F" for a in actions),
        gradients=0 if last else backwards_left,
    )
    with ctx:
        for action in actions:
            m = action.micro
            if action.kind == "F":
                if first:
                    x = micro_batches[m][0].to(engine.device)
                else:
                    x = links.recv_activation().requires_grad_()
                    inputs[m] = x
                with _timed(times, "forward"):
                    out = engine(x)
                    if last:
                        outputs[m] = math.loss_fn(out, micro_batches[m][1].to(engine.device))
                        losses.append(outputs[m].detach())
                if not last:
                    links.send_activation(out)
                    outputs[m] = out
            else:
                out = outputs.pop(m)
                backwards_left -= 1
                grad = None if last else links.recv_gradient()
                if tied and backwards_left == 0:
                    with _timed(times, "comm"):
                        tied.before_last_backward(zero0=not coalesce)
                with _timed(times, "backward"):
                    if last:
                        engine.backward(out)
                    else:
                        engine.backward((out * grad).sum(), scale_wrt_gas=False)
                if not first:
                    links.send_gradient(inputs.pop(m).grad)
                if backwards_left == 0:
                    with _timed(times, "comm"):
                        if tied:
                            tied.after_last_backward(zero0=not coalesce)
                        if math.sync_grads:
                            math.sync_grads()
                if not coalesce:
                    if backwards_left == 0:  # gradients are final (and all-reduced): measure
                        grad_norm = replica_grad_norm(engine.module, math.norm_group, math.tp_rank)
                    with _timed(times, "optimizer"):
                        engine.step()
        block_end = time.perf_counter()
    times["comm"] += time.perf_counter() - block_end  # ZeRO 1-3: the step's one reduction
    if coalesce:
        with _timed(times, "optimizer"):
            for _ in micro_batches:
                engine.step()
    with _timed(times, "comm"):
        links.wait()
    times["pipeline_wait"] = links.reset_recv_wait()
    result.loss = torch.stack(losses).double().mean() if last else None
    result.grad_norm = grad_norm
    return result
