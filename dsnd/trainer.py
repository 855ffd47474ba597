"""The training loop: an orchestrator over data, model, engine and metrics, not an engine itself.

Every layout runs the same way: this rank builds its pipeline stage (all layers when pp = 1) in
one DeepSpeed engine sharded over its data-parallel group, and each optimizer step runs the
stage's schedule (1F1B or GPipe over `gas` micro-batches) through `pipeline.executor`. The loss
is the mean over every micro-batch of every data-parallel rank, i.e. over the global batch, which
no parallel layout changes; the last stage computes it and every rank reports it.

A resumed run loads its checkpoint (any layout) and continues at the saved step: the batch of
step k is a function of (seed, k) alone, so the data position is the step. Checkpoints are saved
every `checkpoint.every` steps and at the end (unless `checkpoint.at_end` is false).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsnd.checkpoint.commit import remove_temporaries
from dsnd.checkpoint.load import load_checkpoint
from dsnd.checkpoint.resume import checkpoint_root
from dsnd.checkpoint.save import save_checkpoint
from dsnd.config.ds_effect import notes as deepspeed_notes
from dsnd.config.resolve import Resolved
from dsnd.config.summary import batch_line, precision, precision_line
from dsnd.data import SampleSet, batch_for_step
from dsnd.data.corpus import Corpus
from dsnd.data.layout import sample_sets, step_layout
from dsnd.data.sources import load_data
from dsnd.data.token_file import check_vocab
from dsnd.distributed.groups import ProcessGroups
from dsnd.engine.loss_scale import current_scale, scale_numbers
from dsnd.engine.public import comms_log_summary
from dsnd.errors import Diverged
from dsnd.flops import flops_per_token, mfu_peak
from dsnd.model.count import layer_table
from dsnd.model.export_dir import ExportOrigin
from dsnd.model.hf_export import export_hf
from dsnd.model.router_aux import wants_router_aux
from dsnd.model.router_load import RouterLoad
from dsnd.pipeline.runner import StageRunner
from dsnd.progress import RankLogFile
from dsnd.report import Reporter, step_row
from dsnd.stop_request import StopRequest
from dsnd.telemetry import (
    check_skips_agree,
    expert_load,
    gather_stats,
    start_step_memory,
    step_numbers,
    stop_agreed,
)

log = logging.getLogger(__name__)


def _evaluate(runner: StageRunner, res: Resolved, groups: ProcessGroups, held_out) -> float:
    """Mean loss over `eval.batches` fixed global batches of the held-out samples."""
    run, losses = res.run, []
    for k in range(run.eval.batches):
        where = (run.train.seed, k, res.batch.train, groups.coord.dp, res.topology.dp,
                 res.batch.micro)  # fmt: skip
        losses.append(runner.evaluate(batch_for_step(held_out, *where),
                                      step_layout(held_out, *where)))  # fmt: skip
    return sum(losses) / len(losses)


def _peak(res: Resolved, engine) -> float | None:
    """This rank's peak FLOP/s for MFU in the run's precision (once per run, so the warning
    that MFU goes unreported for an unknown GPU is logged once)."""
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    dtype = precision(res.ds)
    peak = mfu_peak(res.run.log.peak_flops, name, dtype)
    if peak is None:
        log.warning("MFU not reported: no %s peak FLOP/s known for %r (set log.peak_flops)",
                    dtype, name)  # fmt: skip
    return peak


def _should_save(run, done: int) -> bool:
    every = run.checkpoint.every
    at_end = run.checkpoint.at_end and done == run.train.steps
    return at_end or (every > 0 and done % every == 0)


def check_finite(step: int, loss: float, norm: float | None) -> None:
    """Diverged (on every rank alike: loss and norm are global) when the step's loss or gradient
    norm is NaN or infinite: every later step would be garbage, and no checkpoint may hold it."""
    if not math.isfinite(loss) or (norm is not None and not math.isfinite(norm)):
        raise Diverged(f"training diverged at step {step}: loss {loss}, grad_norm {norm}; "
                       "stopped without saving this state (lower the learning rate, then resume "
                       "from the last checkpoint)")  # fmt: skip


def train(
    res: Resolved,
    groups: ProcessGroups,
    resume: str | None = None,
    stop: StopRequest | None = None,
    job_id: str | None = None,
) -> list[dict[str, Any]]:
    """Train up to `train.steps` optimizer steps, from the checkpoint `resume` (a verified step
    directory) if given; returns the metric rows of the steps run (identical on every rank).
    Checkpoints record `job_id`, so that a restart of this job finds its own.

    When `stop` is requested on any rank (SIGTERM, Ctrl-C), every rank finishes the same step,
    a checkpoint is saved there, and training ends early (the last row has "stopped": True).
    A non-finite loss or gradient norm raises Diverged before anything of that step is saved.
    Every rank logs to `log.dir/logs/rank_XXXXX.log`, including the traceback it fails with."""
    logfile = RankLogFile(res.run.log.dir, dist.get_rank(), groups.coord)
    try:
        return _train(res, groups, resume, stop, job_id)
    except BaseException:
        logfile.exception("rank %d failed", dist.get_rank())
        raise
    finally:
        logfile.close()


@dataclass
class _Stage:
    """What the loop needs, set up once: the stage's runner, the data, where checkpoints go and
    the step to start at."""

    runner: StageRunner
    corpus: Corpus
    samples: SampleSet
    held_out: SampleSet | None
    root: str
    start: int
    router_load: RouterLoad | None = None  # an MoE model's tokens per expert, counted per step


def _setup(res: Resolved, groups: ProcessGroups, resume: str | None) -> _Stage:
    run = res.run
    torch.manual_seed(run.train.seed)
    corpus = load_data(run.data, run.model)
    check_vocab(corpus.vocab_size, res.model.vocab_size, corpus.name)
    samples, held_out = sample_sets(corpus, run.model.seq_len, run.data.packing,
                                    run.eval.fraction if run.eval.every else None)  # fmt: skip
    root = checkpoint_root(run)
    if dist.get_rank() == 0:
        for name in remove_temporaries(root):
            log.warning("removed %s/%s, left by a save that did not finish", root, name)
    runner = StageRunner(res, groups, load_hf=resume is None)
    engine = runner.engine
    total = sum(n for _, _, n in layer_table(res.model))
    log.info("stage %d of %d holds global layers %s: %s of the model's %s parameters, "
             "ZeRO-%d over dp=%d x cp=%d, tp=%d, ep=%d", groups.coord.pp, res.topology.pp,
             list(engine.module.global_indices),
             f"{res.plan.stage_parameters(res.model)[groups.coord.pp]:,}",
             f"{total:,}", res.plan.zero_stage, res.topology.dp, res.topology.cp,
             res.topology.tp, res.run.parallel.ep)  # fmt: skip
    start = 0 if resume is None else _resume(engine, res, resume, corpus)
    own_tokens = groups.coord.tp == 0 or res.run.parallel.sequence_parallel  # see RouterLoad
    load = RouterLoad(engine.module, res.model.config, res.model.num_layers, own_tokens) \
        if res.model.family.moe else None  # fmt: skip
    return _Stage(runner, corpus, samples, held_out, root, start, load)


def _resume(engine, res: Resolved, resume: str, corpus: Corpus) -> int:
    """Load checkpoint `resume` into the engine; the step it was saved at."""
    manifest = load_checkpoint(engine, res, resume)
    if dist.get_rank() == 0:
        log.info("resumed from %s at step %d (saved with pp=%d tp=%d dp=%d, ZeRO-%d)",
                 resume, manifest["step"], *(manifest["topology"][k] for k in ("pp", "tp", "dp")),
                 manifest["zero_stage"])  # fmt: skip
        if manifest["corpus"]["sha256"] != corpus.fingerprint:
            log.warning("the corpus differs from the checkpoint's (%s): same positions, "
                        "different data", manifest["corpus"]["name"])  # fmt: skip
    return manifest["step"]


def _log_start(res: Resolved, st: _Stage) -> None:
    log.info("training %s on %s (%d samples), layout pp=%d dp=%d cp=%d tp=%d, ZeRO-%d, "
             "schedule %s", res.model.describe(), st.corpus.name, len(st.samples),
             res.topology.pp, res.topology.dp, res.topology.cp, res.topology.tp,
             res.plan.zero_stage, res.plan.schedule)  # fmt: skip
    log.info("%s", batch_line(res.batch, res.topology))
    log.info("%s", precision_line(res.ds))
    for note in res.ds_notes:
        log.info("%s: %s", res.ds_path, note)
    for note in deepspeed_notes(res.ds):
        log.warning(note)


def _step(res: Resolved, groups: ProcessGroups, st: _Stage, step: int, flops: tuple,
          stop: StopRequest | None) -> tuple[dict[str, Any], dict[str, Any], bool]:  # fmt: skip
    """Optimizer step `step` (0-based): its metrics row, its TensorBoard numbers, and whether
    every rank agreed to stop after it. `flops` is (FLOPs per token, peak FLOP/s)."""
    run, engine = res.run, st.runner.engine
    lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step will use
    scale = current_scale(engine)  # fp16: the loss scale this step's gradients carry
    start_step_memory(engine.device)  # CUDA: the peak reported below is this step's
    t0 = time.perf_counter()
    where = (run.train.seed, step, res.batch.train, groups.coord.dp, res.topology.dp,
             res.batch.micro)  # fmt: skip
    result = st.runner.run(batch_for_step(st.samples, *where), step_layout(st.samples, *where))
    loss, norm = st.runner.report(result)
    scaling = scale_numbers(engine, scale)
    if scaling.get("skipped"):  # overflowed at this scale: skipped by design, not diverged
        norm = None
    check_finite(step + 1, loss, norm)
    elapsed = time.perf_counter() - t0
    stats = gather_stats(result.times, engine, stop is not None and stop.requested,
                         result.activation_peak_bytes)  # fmt: skip
    check_skips_agree(stats)
    numbers = step_numbers(stats, res.topology, elapsed, res.tokens_per_step, res.batch.train,
                           *flops)  # fmt: skip
    row = step_row(step + 1, loss, lr, norm, elapsed, res.tokens_per_step, numbers) | scaling
    if st.router_load is not None:
        load, sent = st.router_load.gathered(engine.device)
        tags, counts = expert_load(load, sent)
        numbers |= tags
        row["moe_tokens_per_expert"] = counts
        if wants_router_aux(res.model.config):  # part of `loss`, as transformers reports it
            row["moe_aux_loss"] = st.runner.aux_loss(result)
            numbers["moe/aux_loss"] = row["moe_aux_loss"]
        if res.run.parallel.ep > 1:  # (token, choice) rows each layer's all-to-all sent off-rank
            row["moe_rows_sent"] = {b: int(sent[int(b)]) for b in counts}
        if st.runner.capacity is not None:  # rows over their expert's capacity, all ranks
            dropped = st.runner.capacity.take().to(engine.device)
            dist.all_reduce(dropped)
            row["moe_dropped_tokens"] = {b: int(dropped[int(b)]) for b in counts}
            for b, n in row["moe_dropped_tokens"].items():
                numbers[f"moe/layer{b}_dropped_share"] = n / sum(counts[b])
    if st.held_out is not None and (step + 1) % run.eval.every == 0:
        row["eval_loss"] = _evaluate(st.runner, res, groups, st.held_out)
        row["eval_perplexity"] = math.exp(min(row["eval_loss"], 50.0))
    return row, numbers, stop_agreed(stats)


def _train(res: Resolved, groups: ProcessGroups, resume: str | None, stop: StopRequest | None,
           job_id: str | None) -> list[dict[str, Any]]:  # fmt: skip
    run = res.run
    st = _setup(res, groups, resume)
    engine = st.runner.engine
    flops = (flops_per_token(res.model, run.model.seq_len), _peak(res, engine))
    reporter = Reporter(res) if dist.get_rank() == 0 else None
    if reporter:
        _log_start(res, st)
    rows: list[dict[str, Any]] = []
    try:
        for step in range(st.start, run.train.steps):
            row, numbers, stopping = _step(res, groups, st, step, flops, stop)
            rows.append(row)
            if reporter:
                reporter.write(row, numbers)
            if _should_save(run, step + 1) or stopping:
                saved = save_checkpoint(engine, res, groups, step + 1, st.root, st.corpus, job_id)
                if saved:
                    log.info("checkpoint %s committed", saved)
            if stopping:
                row["stopped"] = True
                if reporter:
                    why = (stop and stop.signal_name) or "another rank"
                    log.warning("stopped at step %d on request (%s); relaunch to resume",
                                step + 1, why)  # fmt: skip
                break
        if (res.ds.get("comms_logger") or {}).get("enabled"):
            _comms_summary(run.log.dir)
        if run.checkpoint.export_hf and not (rows and rows[-1].get("stopped")):
            said = export_hf(engine.module, run.checkpoint.export_hf, res.model, groups.data,
                             ExportOrigin(st.root, run.train.steps), engine.device)  # fmt: skip
            if said:  # rank 0: says where the model went
                log.info("%s", said)
        if reporter:  # the closing line: where everything the run wrote is
            log.info("outputs: metrics %s, checkpoints %s%s", reporter.metrics.path, st.root,
                     f", export {run.checkpoint.export_hf}" if run.checkpoint.export_hf else "")
    finally:
        if reporter:
            reporter.close()
        engine.destroy()
    return rows


def _comms_summary(log_dir: str) -> None:
    """DeepSpeed's comms_logger summary at the end of a run (collective), as a DeepSpeed training
    script prints it with `deepspeed.comm.log_summary()`: rank 0 prints the table to its log and
    writes the numbers to ``log.dir/comms_summary.json``. It counts the collectives DeepSpeed
    runs (ZeRO's reductions and gathers), not dsnd's pipeline sends."""
    summary = comms_log_summary()
    if dist.get_rank() == 0 and summary is not None:
        path = os.path.join(log_dir, "comms_summary.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1, default=str)
        log.info("DeepSpeed's communication summary written to %s", path)
