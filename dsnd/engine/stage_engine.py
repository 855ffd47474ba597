"""One pipeline stage's DeepSpeed engine as the executor drives it, through one optimizer step:

    begin()  ->  forward / backward (or backward_input + backward_weight) per micro-batch
             ->  reduce()  ->  step()

Gradients accumulate locally on each rank until `reduce()`, the step's one data-parallel
reduction; `step()` then moves the optimizer once.

- ZeRO 1-3: the backwards run inside `engine.coalesce_grad_reduction()`, whose exit is the
  reduction. Without it ZeRO-3 gives silently wrong gradients once several forwards precede
  their backwards (1F1B's warm-up; the 1F1B ZeRO-3 cases of
  `tests/distributed/test_parity_pipeline.py` hold the losses to the single-process run's).
  DeepSpeed forbids `engine.step()` inside the block, and counts one `step()` per micro-batch
  (the optimizer moves at the last), so `step()` calls it once per micro-batch after it.
- ZeRO-0 cannot coalesce (nor can DeepSpeed's BF16_Optimizer wrapper, which bf16 with fp32
  gradient accumulation gets at ZeRO-1). dsnd owns its accumulation boundary with the public
  `set_gradient_accumulation_boundary`: False through every backward (a stage runs v × m of
  them under interleaving), True for `allreduce_gradients()` and for the last of the m
  `step()` calls.

Zero-bubble schedules split a backward into the input gradient (`backward_input`) and the
weight gradient (`backward_weight`) with torch's own `torch.distributed.pipelining._backward`
(`stage_backward_input` keeps the intermediate gradients the weight pass starts from, so nothing
is computed twice). That pass runs on the module itself, outside DeepSpeed's forward and
backward: DeepSpeed's output hooks would scale the gradient by 1/gas a second time (ZeRO 1-3)
or refuse a direct backward (ZeRO-0). Gradients land in `.grad`, which ZeRO-0's all-reduce and
ZeRO 1-2's coalesced flush read. ZeRO-3 releases a layer's gathered parameters after the input
pass, so the plan refuses the split there. The loss is divided by the accumulation steps here, as
`engine.backward` would.

Every schedule's whole backwards run that way too where it is the same computation (`plain`:
ZeRO 1-2 coalescing, no fp16 loss scale): `forward_plain`, then torch's backward of the loss / gas
(`backward_loss_plain`: `engine.backward`'s loss / gas, times a loss scale of 1) or of an inner
stage's output with the received gradient (`backward_plain`), where DeepSpeed needs a scalar
surrogate, (output * grad).sum(). DeepSpeed's forward pre/post hooks (timers, flops profiler)
are the module's own and still run. On llama-tiny's first stage at pp=2 (fp32, ZeRO-1, one
thread): forward + backward per micro-batch 6.59 -> 5.78 ms, medians (docs/benchmarks.md, the
`dsnd bench pipeline` section).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from dsnd.engine.build import replica_grad_norm
from dsnd.engine.loss_scale import (
    current_scale,
    loss_for_backward,
    scales_gradients,
    surrogate_for_backward,
)


class StageEngine:
    """A built DeepSpeed engine (`engine`) with the step protocol above."""

    def __init__(
        self,
        engine: Any,
        norm_group: dist.ProcessGroup,
        tp_rank: int,
        reshard_after_forward: bool = True,
    ) -> None:
        self.engine = engine
        self.zero = engine.zero_optimization_stage()
        self.keep_gathered = self.zero == 3 and not reshard_after_forward
        # ZeRO 1-3 coalesce, except under DeepSpeed's BF16_Optimizer wrapper (bf16 with fp32
        # gradient accumulation at ZeRO-1), which cannot: it takes ZeRO-0's boundary path
        self.coalesce = self.zero > 0 and hasattr(engine.optimizer, "_coalesce_grad_reduction")
        # forwards and backwards may take the zero-bubble path (module docstring): ZeRO 1-2's
        # coalesced flush reads `.grad` as it is; fp16 keeps DeepSpeed's scaled backward, and a
        # separate accumulation dtype (`grad_accum`, filled in DeepSpeed's backward) its own
        accumulates_apart = getattr(engine.optimizer, "use_grad_accum_attribute", False)
        self.plain = (
            self.coalesce
            and self.zero in (1, 2)
            and not scales_gradients(engine)
            and not accumulates_apart
        )
        self.device = engine.device
        self.gas = engine.gradient_accumulation_steps()
        self._norm_group, self._tp_rank = norm_group, tp_rank
        self._coalescing: contextlib.ExitStack | None = None

    def begin(self) -> None:
        """Start a step: from here on backwards only accumulate local gradients."""
        if self.keep_gathered:
            claim_for_step(self.engine.module)
        if self.coalesce:
            self._coalescing = contextlib.ExitStack()
            self._coalescing.enter_context(self.engine.coalesce_grad_reduction())
        else:
            self.engine.set_gradient_accumulation_boundary(False)

    def forward(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        return self.engine(x, chunk=chunk)

    def backward_loss(self, loss: torch.Tensor) -> None:
        """Backward of the last stage's loss (DeepSpeed divides it by the accumulation steps)."""
        self.engine.backward(loss_for_backward(self.engine, loss))

    def backward_output(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward of an inner stage's `output`, given the gradient the next stage sent."""
        surrogate = surrogate_for_backward(self.engine, output, grad)
        self.engine.backward(surrogate, scale_wrt_gas=False)

    # ---- outside DeepSpeed's forward and backward: inner outputs, zero bubble ---------------

    def forward_plain(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """Forward outside DeepSpeed's output hooks (for `backward_plain`, `backward_input` /
        `backward_weight`)."""
        return self.engine.module(x, chunk=chunk)

    def backward_loss_plain(self, loss: torch.Tensor) -> None:
        """`backward_loss` of a `forward_plain` loss, where `plain`."""
        torch.autograd.backward(loss / self.gas)

    def backward_plain(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """`backward_output` of a `forward_plain` output, where `plain`: the gradient the next
        stage sent carries 1/gas already."""
        torch.autograd.backward(output, grad)

    def backward_input(
        self,
        output: torch.Tensor,
        grad: torch.Tensor | None,
        inputs: list[torch.Tensor],
        leaves: Iterable[torch.Tensor],
    ) -> Any:
        """d(loss)/d(inputs) into the inputs' `.grad`; returns what `backward_weight` needs.
        `grad` None means `output` is the loss (scaled by 1/gas here)."""
        output = output * current_scale(self.engine) / self.gas if grad is None else output
        weights = self._weights(leaves)
        if not inputs:  # the first stage: no input gradient; the weight pass does it all
            return ("whole", output, grad, weights)
        _, groups = stage_backward_input(
            [output], None if grad is None else [grad], inputs, iter(weights)
        )
        return ("split", groups, weights)

    def backward_weight(self, state: Any) -> None:
        """The weight gradients of one `backward_input`, accumulated into `.grad`."""
        if state[0] == "whole":
            _, output, grad, weights = state
            torch.autograd.backward(output, grad, inputs=weights)
        else:
            _, groups, weights = state
            stage_backward_weight(iter(weights), groups)

    def _weights(self, leaves: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return params + [t for t in leaves if t.requires_grad]

    # ---- the step's end ----------------------------------------------------------------------

    def reduce(self) -> None:
        """The step's one data-parallel gradient reduction."""
        if self.coalesce:
            self._coalescing.close()
            self._coalescing = None
        else:
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.allreduce_gradients()

    def step(self) -> float | None:
        """Move the optimizer once; returns the replica's gradient norm where DeepSpeed keeps
        none (ZeRO-0, measured here before the step as ZeRO 1-3 report it), else None."""
        norm = None
        if self.zero == 0:
            norm = replica_grad_norm(self.engine.module, self._norm_group, self._tp_rank)
            norm /= current_scale(self.engine)  # fp16's gradients carry the loss scale
        for i in range(self.gas):
            if not self.coalesce:
                self.engine.set_gradient_accumulation_boundary(i == self.gas - 1)
            self.engine.step()
        return norm


STEP_CLAIM = -1  # not the ds_id of any module


def claim_for_step(module: torch.nn.Module) -> None:
    """Keep the stage's ZeRO-3 parameters gathered until the optimizer step
    (`parallel.reshard_after_forward: false`). DeepSpeed 0.19.8 partitions a gathered parameter
    once no module is using it, i.e. its `ds_active_sub_modules` set is empty; a claim that no
    module releases keeps it whole through every micro-batch's forward and backward. The ZeRO-3
    optimizer's `step()` first partitions every parameter (`_partition_all_parameters`, which
    resets those sets), overflow or not, so the claim ends with the step. At pp=2 x dp=2, stage
    0's all-gathers per step, in units of its parameters, 4 at m=2 and 16 at m=8 become 1 and 1;
    losses bit-identical (docs/benchmarks.md, "Communication"; `dsnd bench zero-comm`)."""
    for p in module.parameters():
        if hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules.add(STEP_CLAIM)
