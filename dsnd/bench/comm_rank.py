"""Rank program of ``dsnd bench zero-comm`` and ``dsnd bench tp-comm``::

    python -m dsnd.bench.comm_rank OUT.json --phase zero|zero-pp|tp [--steps N] [--warmup W]
                                            [--set KEY=VALUE ...]

Each run of a phase is one `StageRunner` (what the trainer runs), built in turn on the same
ranks; `warmup` optimizer steps run uncounted (ZeRO-3 records its module trace in the first),
then `steps` more each run inside a `dsnd.bench.comm_count.CommCounter`, which sees every
collective and message the step issues, by dsnd and by DeepSpeed. Counted per step and summed
per group kind (dp: the stage's data-parallel group; pp: its pipeline; tp: its tensor group),
label and op.

- ``zero`` (2 ranks, pp=1 x dp=2): ZeRO-1, 2 and 3 with dsnd's shipped JSONs and one
  micro-batch per step; ZeRO-3 with ``stage3_max_reuse_distance: 0``; ZeRO-2 with DeepSpeed's
  default ``use_multi_rank_bucket_allreduce: true``.
- ``zero-pp`` (4 ranks, pp=2 x dp=2, 1F1B): ZeRO-1 and 2 at m=2 micro-batches per step; ZeRO-3 at
  m=2 and m=8, as shipped and with every parameter persistent
  (``stage3_param_persistence_threshold`` above the largest parameter: gathered once per step,
  after the optimizer step, and kept).
- ``tp`` (2 ranks, tp=2, ZeRO-0): one micro-batch, without and with sequence parallelism, and
  without it but with every layer's activations checkpointed; labels from forward hooks on each
  layer and gradient hooks on its output say which layer's forward or backward issued a
  collective (``forward/block1``, ``backward/head``, ``forward/loss``: the vocab-parallel
  cross-entropy after the head, ``step``: after the embedding's weight gradient, the step's
  end).

Per run each rank records the stage's parameter bytes, the counted steps' summaries, the
model-state bytes after the last step (`dsnd.engine.memory.state_bytes`) and the losses; rank 0
writes them all to OUT.json and `dsnd.bench.comm_results` turns them into rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsnd.bench import rank
from dsnd.bench.comm_count import CommCounter, summarize
from dsnd.bench.comm_results import WORLDS
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.distributed.groups import ProcessGroups, run_groups
from dsnd.engine.memory import state_bytes
from dsnd.pipeline.runner import StageRunner
from dsnd.pipeline.stage import zero3_dtype

PERSIST = "ds.zero_optimization.stage3_param_persistence_threshold=1000000000"
"""Every parameter of a tiny model persistent: ZeRO-3 keeps it gathered (knob for `zero-pp`)."""
KEEP = "parallel.reshard_after_forward=false"
"""dsnd's knob: each stage's parameters stay gathered from first use to the optimizer step."""
NO_REUSE = (
    "ds.zero_optimization.stage3_max_reuse_distance=0",
    "ds.zero_optimization.stage3_prefetch_bucket_size=0",
)
"""ZeRO-3 releases each layer's parameters after its forward and gathers them again in backward:
by default DeepSpeed keeps those reused within 1e9 elements, and those its prefetch (5e6 elements
in dsnd's JSON) already fetched for a later use: every parameter of a tiny model."""
MULTI_RANK = "ds.zero_optimization.use_multi_rank_bucket_allreduce=true"
CHECKPOINT_EVERY_LAYER = "parallel.activation_checkpoint_interval=1"


def _batch(micro_batches: int) -> list[str]:
    return ["ds.train_batch_size=null", f"ds.gradient_accumulation_steps={micro_batches}"]


def _zero(stage: int, micro_batches: int, *extra: str) -> list[str]:
    return [f"deepspeed={rank.ds_json(stage)}", *_batch(micro_batches), *extra]


PIPE = ("parallel.pp=2", "parallel.schedule=1f1b", "parallel.partition=parameters")
PHASES: dict[str, tuple[int, dict[str, list[str]]]] = {
    "zero": (
        WORLDS["zero"],
        {
            "zero1": _zero(1, 1),
            "zero2": _zero(2, 1),
            "zero3": _zero(3, 1),
            "zero3-no-reuse": _zero(3, 1, *NO_REUSE),
            "zero2-multi-rank": _zero(2, 1, MULTI_RANK),
        },
    ),
    "zero-pp": (
        WORLDS["zero-pp"],
        {
            "pp2-zero1-m2": _zero(1, 2, *PIPE),
            "pp2-zero2-m2": _zero(2, 2, *PIPE),
            "pp2-zero3-m2": _zero(3, 2, *PIPE),
            "pp2-zero3-m8": _zero(3, 8, *PIPE),
            "pp2-zero3-persist-m2": _zero(3, 2, *PIPE, PERSIST),
            "pp2-zero3-persist-m8": _zero(3, 8, *PIPE, PERSIST),
            "pp2-zero3-keep-m2": _zero(3, 2, *PIPE, KEEP),
            "pp2-zero3-keep-m8": _zero(3, 8, *PIPE, KEEP),
        },
    ),
    "tp": (
        WORLDS["tp"],
        {
            "tp2": _zero(0, 1, "parallel.tp=2"),
            "tp2-sp": _zero(0, 1, "parallel.tp=2", "parallel.sequence_parallel=true"),
            "tp2-checkpointed": _zero(0, 1, "parallel.tp=2", CHECKPOINT_EVERY_LAYER),
        },
    ),
}
"""Each phase's ranks and its runs' keys (``--set`` items are added to every run)."""


def group_kinds(groups: ProcessGroups) -> dict[str, list[int]]:
    """The ranks of this rank's data-parallel, pipeline and tensor groups, for `summarize`."""
    return {
        kind: dist.get_process_group_ranks(group)
        for kind, group in (("dp", groups.data), ("pp", groups.pipe), ("tp", groups.tensor))
    }


def layer_labels(runner: StageRunner, counter: CommCounter) -> None:
    """Hooks that label each collective with the layer whose forward or backward issued it:
    ``forward/<layer>``; ``backward/<layer>`` from a hook on the layer's output gradient
    (with activation checkpointing this includes the layer's recomputed forward, whose end no
    hook sees: torch stops recomputing once it has the tensors backward needs);
    ``forward/loss`` after the head; ``step`` after the embedding's weight gradient."""
    stack = runner.engine.module
    last = max(stack.global_indices)
    names = {0: "embed", last - 1: "norm", last: "head"}

    def set_label(label: str):
        def hook(*_) -> None:
            counter.label = label

        return hook

    for key, layer in stack.layers.items():
        index = int(key)
        name = names.get(index, f"block{index}")

        def before(*_, name=name) -> None:
            in_backward = counter.label.startswith("backward/")
            counter.label = f"{'backward' if in_backward else 'forward'}/{name}"

        def after(module, args, out, name=name, index=index) -> None:
            if counter.label.startswith("backward/"):
                return  # a recomputation
            if out.requires_grad:
                out.register_hook(set_label(f"backward/{name}"))
            if index == last:
                counter.label = "forward/loss"

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
    for p in stack.layers["0"].parameters():
        p.register_post_accumulate_grad_hook(set_label("step"))


def stage_param_bytes(runner: StageRunner) -> int:
    """Bytes of this stage's parameters (this rank's tensor-parallel shards, whole: ZeRO-3's
    partitioned ones counted at their full size)."""
    total = 0
    for p in runner.engine.module.parameters():
        source = getattr(p, "ds_tensor", p)
        total += getattr(p, "ds_numel", p.numel()) * source.element_size()
    return total


def measure(res: Resolved, steps: int, warmup: int, labelled: bool) -> dict[str, Any]:
    """One run: its stage's parameter bytes, each counted step's summary, the model-state bytes
    after the last step and every step's loss."""
    groups = run_groups(res)
    samples = rank.sample_set(res)
    with rank.stage_runner(res, groups) as runner:
        kinds = group_kinds(groups)
        counter = CommCounter()
        if labelled:
            layer_labels(runner, counter)
        counted, losses = [], []
        for step in range(warmup + steps):
            micro = rank.step_batches(res, samples, groups, step)
            dist.barrier()
            if step < warmup:
                result = runner.run(micro)
            else:
                counter.calls.clear()
                counter.label = "forward/embed" if labelled else ""
                with counter:
                    result = runner.run(micro)
                counted.append(summarize(counter.calls, kinds))
            losses.append(runner.report(result)[0])
        return {
            "stage": groups.coord.pp,
            "psi_bytes": stage_param_bytes(runner),
            "steps": counted,
            "state": state_bytes(runner.engine),
            "losses": losses,
        }


def layout(res: Resolved) -> dict[str, Any]:
    m = res.run.model
    return {
        "pp": res.topology.pp,
        "dp": res.topology.dp,
        "tp": res.topology.tp,
        "micro": res.batch.micro,
        "micro_batches": res.batch.gas,
        "seq_len": m.seq_len,
        "hidden": res.model.hidden_size,
        "layers": res.model.num_layers,
        "sequence_parallel": res.run.parallel.sequence_parallel,
        "activation_checkpoint_interval": res.run.parallel.activation_checkpoint_interval,
        "zero": res.plan.zero_stage,
        "element_bytes": torch.empty((), dtype=zero3_dtype(res.ds)).element_size(),
    }


def run_phase(phase: str, runs: dict[str, Resolved], steps: int, warmup: int) -> dict[str, Any]:
    """Every run of `phase` in turn; the raw JSON (every rank's records)."""
    out: dict[str, Any] = {"phase": phase, "runs": {}}
    for name, res in runs.items():
        start = time.perf_counter()
        mine = measure(res, steps, warmup, labelled=phase == "tp")
        mine["seconds"] = time.perf_counter() - start
        out["runs"][name] = {"layout": layout(res), "ranks": rank.gather(mine)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = rank.parser("dsnd.bench.comm_rank", steps=1, warmup=1)
    parser.add_argument("--phase", choices=tuple(PHASES), required=True)
    args = parser.parse_args(argv)
    world, keys = PHASES[args.phase]
    rank.run(
        args.out,
        f"phase {args.phase}",
        world,
        lambda: {
            name: resolve(load(None, [*sets, *args.sets]), world) for name, sets in keys.items()
        },
        lambda runs: run_phase(args.phase, runs, args.steps, args.warmup),
    )


if __name__ == "__main__":
    main()
