"""This rank's pipeline stage, ready to run optimizer steps: engine, schedule, links, ties.

Shared by the trainer and `dsnd bench`, so what is measured is exactly what trains.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dsnd.config.resolve import Resolved
from dsnd.cp.loss import context_parallel_loss
from dsnd.data.batch_extras import BatchExtras
from dsnd.distributed.groups import ProcessGroups
from dsnd.distributed.mpu import Mpu
from dsnd.engine.build import build_engine
from dsnd.engine.compat import scope_zero3_trace_checks
from dsnd.engine.deepspeed_api import unpartitioned_shape
from dsnd.engine.experts import after_build
from dsnd.engine.experts import prepare as prepare_experts
from dsnd.engine.hsdp import replicate_gradients
from dsnd.engine.loss_scale import current_scale, scale_numbers
from dsnd.engine.memory import state_bytes
from dsnd.engine.public import accelerator_device, comms_log_summary
from dsnd.engine.stage_engine import StageEngine
from dsnd.model import param_groups
from dsnd.model.documents import Documents
from dsnd.model.hf_io import load_hf_stage
from dsnd.moe.capacity import Capacity
from dsnd.moe.numbers import MoeNumbers
from dsnd.moe.router_aux import RouterAux, wants_router_aux
from dsnd.moe.router_load import RouterLoad
from dsnd.pipeline.executor import Batches, Executor, StageMath, StageShape, StepResult
from dsnd.pipeline.p2p import StageLinks
from dsnd.pipeline.stage import build_stage, context_parallel, expert_parallel, tensor_parallel
from dsnd.pipeline.tied import TiedWeights
from dsnd.plan.plan import Plan
from dsnd.tp import allreduce_partial_grads, vocab_parallel_cross_entropy


def _check_same_plan(plan: Plan) -> None:
    """Every rank resolved its plan alone; stop here if two differ (a measured partition read
    from different caches on two hosts would otherwise hang at the first message)."""
    mine = (plan.parts, plan.schedule, plan.chunks, plan.micro_batches)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(other != mine for other in every):
        parts = sorted({str(list(o[0])) for o in every})
        raise RuntimeError(
            f"ranks resolved different plans (stage boundaries {', '.join(parts)}): with "
            "parallel.partition: profile every host must read the same measurements (a log.dir "
            "shared by all hosts, or dsnd launch, which measures once before the ranks start)"
        )


class StageRunner:
    """One DeepSpeed engine over this rank's stage (all its chunks), sharded over the stage's
    data group, and the executor that runs the plan's program for it."""

    def __init__(self, res: Resolved, groups: ProcessGroups, load_hf: bool = True) -> None:
        self.groups = groups
        plan, stage = res.plan, groups.coord.pp
        _check_same_plan(plan)
        if plan.pp > 1:
            scope_zero3_trace_checks(groups.data, accelerator_device())
        # the document layout every block reads (data.packing: documents), set per micro-batch
        self.documents = Documents() if res.run.data.packing == "documents" else None
        self.engine = self._engine(res, groups, load_hf)
        self.program = list(plan.programs[stage])
        self.links = StageLinks(
            groups.channels, dist.get_process_group_ranks(groups.pipe), self.engine.device
        )
        tp, self.cp = tensor_parallel(res, groups), context_parallel(res, groups)
        seq = res.run.model.seq_len // self.cp.size // (tp.size if tp.sequence_parallel else 1)
        math = self._math(res, tp)
        aux_width = math.aux.width if math.aux is not None else 0
        self.shape = StageShape(
            res.batch.micro, seq, res.model.hidden_size, self._dtype(), aux_width
        )
        # tensor-parallel ranks without sequence parallelism route the same tokens: one counts
        self._moe(res, groups, counts=groups.coord.tp == 0 or tp.sequence_parallel)
        stage_engine = StageEngine(
            self.engine, groups.replica, groups.coord.tp, res.run.parallel.reshard_after_forward
        )
        self.executor = Executor(
            stage_engine, self.links, self.shape, math, plan.role(stage), self.tied, self.documents
        )

    def _engine(self, res: Resolved, groups: ProcessGroups, load_hf: bool):
        """The stage's layers (`build_stage`; the HF weights loaded into them) in one DeepSpeed
        engine, sharded over ZeRO's groups: the data group, or with hybrid sharding its shard
        (`dsnd.engine.hsdp`); sets `tied`."""
        zero_groups = groups.for_zero()
        ep = expert_parallel(groups)
        stack = build_stage(res, zero_groups, self.documents, ep)
        # before the engine exists: a borrowing stage must not hand the tied weight to ZeRO
        self.tied = TiedWeights(stack, res.plan.ties, groups)
        if load_hf and res.run.model.init_from:  # into the stage's layers, before ZeRO takes them
            load_hf_stage(stack, res.run.model.init_from, res.model)
        ep_groups = (ep.group, ep.data) if ep is not None else (None, None)
        prepare_experts(stack, res.plan.zero_stage, *ep_groups)
        groups_of_params = param_groups(stack, unpartitioned_shape)
        engine = build_engine(stack, res.ds, groups_of_params, Mpu(zero_groups))
        after_build(engine, ep_groups[0])
        if groups.replicate is not None:
            replicate_gradients(engine.optimizer, groups.replicate)
        return engine

    def _dtype(self) -> torch.dtype:
        """What the engine computes and sends in."""
        if self.engine.bfloat16_enabled():
            return torch.bfloat16
        return torch.float16 if self.engine.fp16_enabled() else torch.float32

    def _moe(self, res: Resolved, groups: ProcessGroups, counts: bool) -> None:
        """An MoE model's counters (`capacity`: rows dropped at `model.moe_capacity_factor`;
        `moe`: its numbers per step), None for a dense model; `counts` where this rank's tokens
        are its own to count."""
        factor, module = res.run.model.moe_capacity_factor, self.engine.module
        self.capacity = (
            None
            if factor is None
            else Capacity(module, factor, res.model.num_layers, counts=counts)
        )
        self.moe = None
        if res.model.family.moe:
            load = RouterLoad(module, res.model.config, res.model.num_layers, counts)
            expert_parallel = groups.expert is not None
            self.moe = MoeNumbers(load, self.capacity, expert_parallel, self.engine.device)

    def _math(self, res: Resolved, tp) -> StageMath:
        """The stage's loss and gradient syncs: vocab-parallel cross-entropy and the partial
        gradients' all-reduce with tp > 1, context-parallel loss scaling, the routers' aux."""
        math = StageMath()
        if tp.size > 1:
            loss = partial(
                vocab_parallel_cross_entropy, group=tp.group, vocab_size=res.model.vocab_size
            )
            params = list(self.engine.module.parameters())
            math = StageMath(loss, partial(allreduce_partial_grads, params, tp.group))
        if self.cp.size > 1:
            math = StageMath(context_parallel_loss(math.loss_fn, self.cp.group), math.sync_grads)
        if wants_router_aux(res.model.config):
            sequence_group = tp.group if tp.size > 1 and tp.sequence_parallel else None
            math = replace(
                math, aux=RouterAux(self.engine.module, res.model.config, sequence_group)
            )
        return math

    def run(self, micro_batches: Batches, layout: BatchExtras | None = None) -> StepResult:
        """This stage's share of one optimizer step (no collective beyond the step's own);
        `layout` gives the micro-batches' loss weights and documents (`dsnd.data.batch_extras`)."""
        return self.executor.step(self.program, self._slices(micro_batches), layout)

    def evaluate(self, micro_batches: Batches, layout: BatchExtras | None = None) -> float:
        """Mean loss of the model as it is over the global batch `micro_batches` (forward only),
        on every rank."""
        return self._global_loss(self.executor.evaluate(self._slices(micro_batches), layout))

    def _slices(self, micro_batches: Batches) -> Batches:
        """This rank's slice of each sequence (all of it without context parallelism)."""
        if self.cp.size == 1:
            return micro_batches
        return [(self.cp.shard(x), self.cp.shard(y)) for x, y in micro_batches]

    def report(self, result: StepResult) -> tuple[float, float | None]:
        """(loss over the global batch, gradient norm over all stages), on every rank."""
        loss = self._global_loss(result.loss)
        norm = result.grad_norm
        if norm is None:
            norm = self.engine.get_global_grad_norm()
        return loss, None if norm is None else float(norm)

    def moe_numbers(self, result: StepResult) -> tuple[dict[str, Any], dict[str, float]]:
        """An MoE model's numbers of the step (`dsnd.moe.numbers`: metrics.jsonl fields and
        TensorBoard tags), on every rank (collective); nothing for a dense model."""
        if self.moe is None:
            return {}, {}
        # the routers' load-balancing loss (part of `report`'s loss) over the global batch
        aux = self._global_loss(result.aux_loss) if self.executor.math.aux is not None else None
        return self.moe.step(aux)

    def loss_scale(self) -> float:
        """The loss scale this step's gradients will carry (fp16; 1.0 otherwise)."""
        return current_scale(self.engine)

    def scale_numbers(self, scale: float) -> dict[str, Any]:
        """After a step taken at loss scale `scale`: the metrics row's fp16 fields (`{}`
        without fp16): the scale, whether DeepSpeed skipped the step, how many it skipped."""
        return scale_numbers(self.engine, scale)

    def step_skipped(self) -> bool:
        """Whether DeepSpeed skipped the optimizer step just taken (an fp16 overflow)."""
        return not self.engine.was_step_applied()

    def model_state_bytes(self) -> float:
        """The bytes of parameters, gradients and optimizer state this rank holds."""
        return float(sum(state_bytes(self.engine).values()))

    def comms_summary(self) -> dict | None:
        """DeepSpeed's comms_logger summary (collective), or None where it logged nothing."""
        return comms_log_summary()

    def _global_loss(self, local: torch.Tensor | None) -> float:
        """The last stage's mean over its data-parallel replicas (and context-parallel slices:
        `dsnd.cp.loss`), sent to every stage."""
        device = self.engine.device
        loss = torch.zeros((), dtype=torch.float64, device=device)
        # a group of one rank needs no collective (gloo would still run one on its thread)
        replicas = dist.get_world_size(self.groups.data)
        if local is not None:
            loss = local.to(device).double()
            if replicas > 1:
                dist.all_reduce(loss, group=self.groups.data)
                loss /= replicas
        stages = dist.get_process_group_ranks(self.groups.pipe)
        if len(stages) > 1:
            dist.broadcast(loss, src=stages[-1], group=self.groups.pipe)
        return loss.item()
