"""Run one stage's share of one optimizer step: its program (`dsnd.plan.schedule`), one
instruction at a time, through a dispatch table. Nothing a stage does in a step is decided
here; the schedule put it in the program.

Per instruction, on a stage holding model chunk(s) of layers in one `StageEngine`:
  recv_act / send_act    the activation from the previous / to the next virtual stage;
  F                      input = tokens (first virtual stage) or the received activation;
                         the last virtual stage computes the loss;
  recv_grad / send_grad  d(loss)/d(output) from the next / d(loss)/d(input) to the previous;
  B                      backward of the loss (scaled 1/gas, and by fp16's loss scale) or of
                         the surrogate (output * grad).sum() (not scaled again; the received
                         gradient carries both: dsnd/engine/loss_scale.py);
  I / W                  the same backward split into input and weight gradients (zero bubble);
  tied_*                 the tied-weight exchange (pipeline/tied.py);
  sp_sum                 the tensor group's sum of partial gradients of replicated parameters
                         (sequence parallelism, per-head norms), before the reduction over data
                         parallel (both are sums, so the order is free);
  reduce, step           the step's one data-parallel reduction and the optimizer step.

With tensor parallelism the last stage's logits are this rank's vocabulary slice and the loss is
vocab-parallel (`StageMath.loss_fn`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsnd.data.batch_extras import BatchExtras
from dsnd.engine.stage_engine import StageEngine
from dsnd.model import lm_loss
from dsnd.model.documents import Documents
from dsnd.moe.router_aux import RouterAux
from dsnd.pipeline.activations import ActivationMeter
from dsnd.pipeline.clock import StepClock, phase_times
from dsnd.pipeline.p2p import StageLinks
from dsnd.pipeline.phases import PHASES
from dsnd.pipeline.tied import TiedWeights
from dsnd.plan import schedule as S
from dsnd.plan.schedule import Instr, StageRole

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StageShape:
    """What flows between stages: (micro, seq, hidden) activations in `dtype`; with `extra`
    values carried along (the load-balancing loss's running sums, `StageMath.aux`), one flat
    tensor of the activations' elements and then those."""

    micro: int
    seq_len: int
    hidden: int
    dtype: torch.dtype
    extra: int = 0

    @property
    def hidden_shape(self) -> tuple[int, int, int]:
        return (self.micro, self.seq_len, self.hidden)

    @property
    def activation(self) -> tuple[int, ...]:
        if not self.extra:
            return self.hidden_shape
        return (self.micro * self.seq_len * self.hidden + self.extra,)

    def unpack(self, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the activations, the extra values in fp32, or None) of a received tensor."""
        if not self.extra:
            return received, None
        cut = received.numel() - self.extra
        return received[:cut].view(self.hidden_shape), received[cut:].float()

    def pack(self, hidden: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """What goes to the next stage: `hidden`, and after it `extra` in the same dtype."""
        if not self.extra:
            return hidden
        return torch.cat([hidden.reshape(-1), extra.to(hidden.dtype)])


@dataclass(frozen=True)
class StageMath:
    """The step's computation besides the layers: the loss and the tensor group's sum."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    sync_grads: Callable[[], None] | None = None  # the sp_sum instruction
    # a mixture of experts' router load-balancing loss (`dsnd.moe.router_aux.RouterAux`):
    # each forward's share is added to the sums the activations carry (`StageShape.extra`),
    # and the last stage adds the loss of the whole forward's sums to the micro-batch's loss
    aux: RouterAux | None = None


@dataclass
class StepResult:
    loss: torch.Tensor | None  # mean over this rank's micro-batches (last stage only)
    grad_norm: float | None  # ZeRO-0 only: DeepSpeed keeps no norm there
    # seconds per phase (`dsnd.pipeline.phases`: disjoint, the bubble is pipeline_wait)
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # seconds per compute instruction kind (F, B, I, W), summed over the step: with the
    # program, what `dsnd.plan.schedule.timeline` needs to predict this stage's bubble
    op_seconds: dict[str, float] = field(default_factory=dict)
    # seconds of each instruction of the program, in order (a receive's include its wait): the
    # spread of the costs `dsnd bench pipeline` replays the step at
    instr_seconds: list[float] = field(default_factory=list)
    # seconds from the step's start to its gradient reduction: the pipelined part (every
    # compute instruction, message and tied exchange), without the reduction and optimizer
    pipelined_s: float = 0.0
    # the most bytes of activations saved for backward this rank held at once in the step
    # (`dsnd.pipeline.activations`)
    activation_peak_bytes: int = 0
    # mean over this rank's micro-batches of the router load-balancing loss (`StageMath`),
    # part of `loss`; None without it
    aux_loss: torch.Tensor | None = None


@dataclass
class _Step:
    """What one step's instructions hand each other, keyed by (micro, chunk)."""

    batches: Batches
    layout: BatchExtras | None = None  # loss weights and document ids (`dsnd.data.batch_extras`)
    inputs: dict = field(default_factory=dict)  # received activations (their .grad goes back)
    outputs: dict = field(default_factory=dict)  # stage outputs, or the loss on the last stage
    grads: dict = field(default_factory=dict)  # received output gradients
    pending_w: dict = field(default_factory=dict)  # state of an I awaiting its W
    losses: list = field(default_factory=list)
    aux_losses: list = field(default_factory=list)
    result: StepResult = field(default_factory=lambda: StepResult(None, None))


class Executor:
    """Runs programs of one stage: `step(program, batches)` and `evaluate(batches)`."""

    def __init__(
        self,
        engine: StageEngine,
        links: StageLinks,
        shape: StageShape,
        math: StageMath,
        role: StageRole,
        tied: TiedWeights | None,
        documents: Documents | None = None,
    ) -> None:
        self.engine, self.links, self.shape = engine, links, shape
        self.math, self.role, self.tied = math, role, tied
        self.documents = documents  # what the layers read the micro-batch's documents from
        # set per program: forwards and backwards outside DeepSpeed's (`StageEngine.plain`;
        # zero-bubble programs always)
        self.plain = False
        self.activations = ActivationMeter(self._not_activations)
        self.clock = StepClock(engine.device)  # host clock on the CPU, CUDA events on a GPU
        self.table: dict[str, Callable[[Instr, _Step], None]] = {
            S.RECV_ACT: self._recv_act,
            S.SEND_ACT: self._send_act,
            S.FORWARD: self._forward,
            S.RECV_GRAD: self._recv_grad,
            S.SEND_GRAD: self._send_grad,
            S.BACKWARD: self._backward,
            S.BACKWARD_INPUT: self._backward_input,
            S.BACKWARD_WEIGHT: self._backward_weight,
            S.TIED_LEND: lambda x, state: self.tied.lend(),
            S.TIED_BORROW: lambda x, state: self.tied.borrow(self.engine.device),
            S.TIED_RETURN: lambda x, state: self.tied.give_back(),
            S.TIED_ADD: lambda x, state: self.tied.add_returned(),
            S.SP_SUM: self._sp_sum,
            S.REDUCE: self._reduce,
            S.STEP: self._step,
        }

    def _virtual(self, x: Instr) -> int:
        return x.chunk * self.role.stages + self.role.stage

    def _is_last(self, x: Instr) -> bool:
        return self._virtual(x) == self.role.stages * self.role.chunks - 1

    def _not_activations(self) -> list[torch.Tensor]:
        """What a forward may save that the activation count leaves out, besides parameters."""
        module = self.engine.engine.module
        return [
            *module.buffers(),
            *module.parameters(),
            *(self.tied.borrowed_leaves() if self.tied else []),
        ]

    def step(
        self, program: list[Instr], batches: Batches, layout: BatchExtras | None = None
    ) -> StepResult:
        """Execute `program` (one optimizer step of this stage) on this rank's micro-batches
        (with `layout`, their loss weights and documents)."""
        state = _Step(batches, layout)
        result = state.result
        self.plain = self.engine.plain or any(x.op == S.BACKWARD_INPUT for x in program)
        self.links.reset_recv_wait()
        self.links.begin_step(self.role, program, self.shape)
        self.engine.begin()
        self.activations.begin()
        self.clock.start()
        for x in program:
            self.table[x.op](x, state)
            self.clock.lap()
        self.links.wait()
        self.clock.lap()
        laps = self.clock.laps()
        result.instr_seconds = laps[: len(program)]
        for x, spent in zip(program, result.instr_seconds, strict=True):
            if x.op in S.COMPUTE:
                result.op_seconds[x.op] = result.op_seconds.get(x.op, 0.0) + spent
        reduce_at = next((i for i, x in enumerate(program) if x.op == S.REDUCE), len(program))
        result.pipelined_s = sum(result.instr_seconds[:reduce_at])
        blocked = self.links.reset_recv_wait()
        phase_times(program, laps, None if self.clock.cuda else blocked, result.times)
        if state.losses:
            state.result.loss = torch.stack(state.losses).double().mean()
        if state.aux_losses:
            state.result.aux_loss = torch.stack(state.aux_losses).double().mean()
        state.result.activation_peak_bytes = self.activations.peak
        return state.result

    # ---- point to point --------------------------------------------------------------------

    def _recv_act(self, x: Instr, state: _Step) -> None:
        state.inputs[x.micro, x.chunk] = self.links.recv(x).requires_grad_()

    def _send_act(self, x: Instr, state: _Step) -> None:
        self.links.send(x, state.outputs[x.micro, x.chunk])

    def _recv_grad(self, x: Instr, state: _Step) -> None:
        state.grads[x.micro, x.chunk] = self.links.recv(x)

    def _send_grad(self, x: Instr, state: _Step) -> None:
        self.links.send(x, state.inputs.pop((x.micro, x.chunk)).grad)

    # ---- compute ---------------------------------------------------------------------------

    def _documents_of(self, x: Instr, state: _Step) -> None:
        """Point the layers at micro-batch x.micro's documents, before its forward and before
        its backward (activation checkpointing recomputes the forward there)."""
        if self.documents is not None:
            docs = state.layout.documents if state.layout is not None else None
            self.documents.use(None if docs is None else docs[x.micro])

    def _loss(
        self, logits: torch.Tensor, x: Instr, state: _Step, sums: torch.Tensor | None
    ) -> torch.Tensor:
        """Micro-batch x.micro's loss: its mean, times its weight in the global batch's mean over
        counted labels (`dsnd.data.batch_extras`; exactly 1 where every label counts), plus the
        routers' load-balancing loss of the forward's `sums`, where the model has one."""
        weight = 1.0 if state.layout is None else state.layout.weights[x.micro]
        if weight == 0.0:  # no label counts: no mean (0/0); zero gradients all the same
            loss = logits.sum() * 0.0
        else:
            loss = self.math.loss_fn(logits, state.batches[x.micro][1].to(self.engine.device))
            loss = loss if weight == 1.0 else loss * weight
        if sums is None:
            return loss
        aux = self.math.aux.loss(sums)  # as transformers adds it: to each forward's loss
        state.aux_losses.append(aux.detach())
        return loss + aux.to(loss.dtype)

    def _forward(self, x: Instr, state: _Step) -> None:
        key = (x.micro, x.chunk)
        self._documents_of(x, state)
        carried = None
        if self._virtual(x) == 0:
            inp = state.batches[x.micro][0].to(self.engine.device)
        else:
            inp, carried = self.shape.unpack(state.inputs[key])
        run = self.engine.forward_plain if self.plain else self.engine.forward
        with self.activations.forward(key):
            out = run(inp, x.chunk)
            sums = None
            if self.math.aux is not None:  # this chunk's layers' share, added to the earlier
                sums = self.math.aux.partial(out.device)
                sums = sums if carried is None else sums + carried
            if self._is_last(x):
                out = self._loss(out, x, state, sums)
                state.losses.append(out.detach())
            else:
                out = self.shape.pack(out, sums)
        state.outputs[key] = out

    def _backward(self, x: Instr, state: _Step) -> None:
        self._documents_of(x, state)
        out = state.outputs.pop((x.micro, x.chunk))
        if self._is_last(x):
            (self.engine.backward_loss_plain if self.plain else self.engine.backward_loss)(out)
        elif self.plain:
            self.engine.backward_plain(out, state.grads.pop((x.micro, x.chunk)))
        else:
            self.engine.backward_output(out, state.grads.pop((x.micro, x.chunk)))
        self.activations.release((x.micro, x.chunk))

    def _backward_input(self, x: Instr, state: _Step) -> None:
        self._documents_of(x, state)
        key = (x.micro, x.chunk)
        out = state.outputs.pop(key)
        grad = None if self._is_last(x) else state.grads.pop(key)
        inputs = [state.inputs[key]] if key in state.inputs else []
        leaves = self.tied.borrowed_leaves() if self.tied else []
        state.pending_w[key] = self.engine.backward_input(out, grad, inputs, leaves)

    def _backward_weight(self, x: Instr, state: _Step) -> None:
        self._documents_of(x, state)
        self.engine.backward_weight(state.pending_w.pop((x.micro, x.chunk)))
        self.activations.release((x.micro, x.chunk))

    # ---- the step's end -------------------------------------------------------------------

    def _sp_sum(self, x: Instr, state: _Step) -> None:
        if self.math.sync_grads:
            self.math.sync_grads()

    def _reduce(self, x: Instr, state: _Step) -> None:
        self.engine.reduce()

    def _step(self, x: Instr, state: _Step) -> None:
        state.result.grad_norm = self.engine.step()

    # ---- forward only --------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches: Batches, layout: BatchExtras | None = None) -> torch.Tensor | None:
        """Forward only: the mean loss over `batches` on the last stage (None elsewhere), with
        the schedule's forwards in GPipe order (micro-batch by micro-batch through every
        chunk)."""
        program = []
        if self.tied:
            program.append(Instr(S.TIED_LEND if self.role.tie == "owner" else S.TIED_BORROW))
        for c in range(self.role.chunks):
            for m in range(len(batches)):
                program += [
                    x
                    for x in S.program([Instr(S.FORWARD, m, c)], self.role)
                    if x.op in (S.RECV_ACT, S.FORWARD, S.SEND_ACT)
                ]
        state = _Step(batches, layout)
        self.engine.engine.eval()
        self.plain = False
        self.links.begin_step(self.role, program, self.shape)
        for x in program:
            self.table[x.op](x, state)
            key = (x.micro, x.chunk)
            if x.op == S.FORWARD:  # nothing goes backward: drop what a backward would need
                state.inputs.pop(key, None)
                if self._is_last(x):
                    state.outputs.pop(key)
            elif x.op == S.SEND_ACT:
                state.outputs.pop(key)
        self.links.wait()
        self.links.reset_recv_wait()
        self.engine.engine.train()
        return torch.stack(state.losses).double().mean() if state.losses else None
