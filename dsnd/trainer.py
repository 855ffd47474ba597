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

import contextlib
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
from dsnd.checkpoint.save import Saver
from dsnd.config.ds_effect import notes as deepspeed_notes
from dsnd.config.resolve import Resolved
from dsnd.config.summary import batch_line, precision, precision_line
from dsnd.data import SampleSet, batch_for_step
from dsnd.data.batch_extras import batch_extras
from dsnd.data.corpus import Corpus
from dsnd.data.counted import counted_line
from dsnd.data.held_out import load_eval_corpus, split_samples
from dsnd.data.sources import load_data
from dsnd.data.token_file import check_vocab
from dsnd.distributed.groups import ProcessGroups
from dsnd.errors import Diverged, WriteFailed
from dsnd.model.count import layer_table
from dsnd.model.export_dir import ExportOrigin
from dsnd.model.hf_export import export_hf
from dsnd.pipeline.runner import StageRunner
from dsnd.report.flops import flops_per_token, mfu_peak
from dsnd.report.progress import RankLogFile
from dsnd.report.reporter import (
    LAYOUT_WHY_ENV,
    Reporter,
    layout_of,
    saved_layout,
    start_mark,
    step_row,
)
from dsnd.report.telemetry import (
    check_skips_agree,
    gather_stats,
    rank_memory,
    start_step_memory,
    step_numbers,
    stop_agreed,
)
from dsnd.stop_request import StopRequest

log = logging.getLogger(__name__)


def _evaluate(runner: StageRunner, res: Resolved, groups: ProcessGroups, held_out) -> float:
    """Mean loss over `eval.batches` fixed global batches of the held-out samples."""
    run, losses = res.run, []
    for k in range(run.eval.batches):
        where = (
            run.train.seed,
            k,
            res.batch.train,
            groups.coord.dp,
            res.topology.dp,
            res.batch.micro,
        )
        losses.append(
            runner.evaluate(batch_for_step(held_out, *where), batch_extras(held_out, *where))
        )
    return sum(losses) / len(losses)


def _peak(res: Resolved, engine) -> float | None:
    """This rank's peak FLOP/s for MFU in the run's precision (once per run, so the warning
    that MFU goes unreported for an unknown GPU is logged once)."""
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    dtype = precision(res.ds)
    peak = mfu_peak(res.run.log.peak_flops, name, dtype)
    if peak is None:
        log.warning(
            "MFU not reported: no %s peak FLOP/s known for %r (set log.peak_flops)", dtype, name
        )
    return peak


def _should_save(run, done: int) -> bool:
    every = run.checkpoint.every
    at_end = run.checkpoint.at_end and done == run.train.steps
    return at_end or (every > 0 and done % every == 0)


def check_finite(step: int, loss: float, norm: float | None) -> None:
    """Diverged (on every rank alike: loss and norm are global) when the step's loss or gradient
    norm is NaN or infinite: every later step would be garbage, and no checkpoint may hold it."""
    if not math.isfinite(loss) or (norm is not None and not math.isfinite(norm)):
        raise Diverged(
            f"training diverged at step {step}: loss {loss}, grad_norm {norm}; "
            "stopped without saving this state (lower the learning rate, then resume "
            "from the last checkpoint)"
        )


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
    mark: dict[str, Any]  # metrics.jsonl's "run_start" (`report.start_mark`)


def _setup(res: Resolved, groups: ProcessGroups, resume: str | None) -> _Stage:
    run = res.run
    torch.manual_seed(run.train.seed)
    corpus = load_data(run.data, run.model)
    check_vocab(corpus.vocab_size, res.model.vocab_size, corpus.name)
    eval_corpus = load_eval_corpus(run)
    if eval_corpus is not None:
        check_vocab(eval_corpus.vocab_size, res.model.vocab_size, eval_corpus.name)
    split = split_samples(run, corpus, eval_corpus)
    counted = counted_line(corpus, split.train, run.data.packing)  # every rank: may refuse
    root = checkpoint_root(run)
    if dist.get_rank() == 0:
        for note in corpus.notes:  # a data.max_bytes cap: what it reads of how much
            log.info("%s", note)
        if counted:
            log.info("%s", counted)
        if split.note:
            log.warning("%s", split.note)
        for name in remove_temporaries(root):
            log.warning("removed %s/%s, left by a save that did not finish", root, name)
    runner = StageRunner(res, groups, load_hf=resume is None)
    engine = runner.engine
    total = sum(n for _, _, n in layer_table(res.model))
    log.info(
        "stage %d of %d holds global layers %s: %s of the model's %s parameters, "
        "ZeRO-%d over dp=%d x cp=%d, tp=%d, ep=%d",
        groups.coord.pp,
        res.topology.pp,
        list(engine.module.global_indices),
        f"{res.plan.stage_parameters(res.model)[groups.coord.pp]:,}",
        f"{total:,}",
        res.plan.zero_stage,
        res.topology.dp,
        res.topology.cp,
        res.topology.tp,
        res.topology.ep,
    )
    start, saved = (0, None) if resume is None else _resume(engine, res, resume, corpus)
    mark = start_mark(start, layout_of(res.topology), resume, saved, os.environ.get(LAYOUT_WHY_ENV))
    return _Stage(runner, corpus, split.train, split.held_out, root, start, mark)


def _resume(engine, res: Resolved, resume: str, corpus: Corpus) -> tuple[int, dict[str, int]]:
    """Load checkpoint `resume` into the engine; the step and the layout it was saved at."""
    manifest = load_checkpoint(engine, res, resume)
    if dist.get_rank() == 0:
        log.info(
            "resumed from %s at step %d (saved with pp=%d tp=%d dp=%d, ZeRO-%d)",
            resume,
            manifest["step"],
            *(manifest["topology"][k] for k in ("pp", "tp", "dp")),
            manifest["zero_stage"],
        )
        if manifest["corpus"]["sha256"] != corpus.fingerprint:
            log.warning(
                "the corpus differs from the checkpoint's (%s): same positions, different data",
                manifest["corpus"]["name"],
            )
    return manifest["step"], saved_layout(manifest)


def _log_start(res: Resolved, st: _Stage) -> None:
    log.info(
        "training %s on %s (%d samples), layout pp=%d dp=%d cp=%d tp=%d, ZeRO-%d, schedule %s",
        res.model.describe(),
        st.corpus.name,
        len(st.samples),
        res.topology.pp,
        res.topology.dp,
        res.topology.cp,
        res.topology.tp,
        res.plan.zero_stage,
        res.plan.schedule,
    )
    log.info("%s", batch_line(res.batch, res.topology))
    log.info("%s", precision_line(res.ds))
    for note in res.ds_notes:
        log.info("%s: %s", res.ds_path, note)
    for note in deepspeed_notes(res.ds):
        log.warning(note)


def _step(
    res: Resolved,
    groups: ProcessGroups,
    st: _Stage,
    step: int,
    flops: tuple,
    stop: StopRequest | None,
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Optimizer step `step` (0-based): its metrics row, its TensorBoard numbers, and whether
    every rank agreed to stop after it. `flops` is (FLOPs per token, peak FLOP/s)."""
    run, engine = res.run, st.runner.engine
    lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step will use
    scale = st.runner.loss_scale()  # fp16: the loss scale this step's gradients carry
    start_step_memory(engine.device)  # CUDA: the peak reported below is this step's
    t0 = time.perf_counter()
    where = (
        run.train.seed,
        step,
        res.batch.train,
        groups.coord.dp,
        res.topology.dp,
        res.batch.micro,
    )
    result = st.runner.run(batch_for_step(st.samples, *where), batch_extras(st.samples, *where))
    loss, norm = st.runner.report(result)
    scaling = st.runner.scale_numbers(scale)
    if scaling.get("skipped"):  # overflowed at this scale: skipped by design, not diverged
        norm = None
    check_finite(step + 1, loss, norm)
    elapsed = time.perf_counter() - t0
    memory = rank_memory(engine.device, st.runner.model_state_bytes)
    stopping = stop is not None and stop.requested
    stats = gather_stats(
        result.times,
        memory,
        st.runner.step_skipped(),
        engine.device,
        stopping,
        result.activation_peak_bytes,
    )
    check_skips_agree(stats)
    numbers = step_numbers(
        stats, res.topology, elapsed, res.tokens_per_step, res.batch.train, *flops
    )
    row = step_row(step + 1, loss, lr, norm, elapsed, res.tokens_per_step, numbers) | scaling
    moe_row, moe_tags = st.runner.moe_numbers(result)  # an MoE model's (`dsnd.moe.numbers`)
    row |= moe_row
    numbers |= moe_tags
    return row, numbers, stop_agreed(stats)


def _should_eval(run, done: int) -> bool:
    """Evaluate after `done` steps: at the end of training, and every eval.every steps (0: every
    checkpoint.every steps, the saves' steps)."""
    every = run.eval.every or run.checkpoint.every
    return done == run.train.steps or (every > 0 and done % every == 0)


def _marked(
    res: Resolved, groups: ProcessGroups, st: _Stage, step: int, row: dict[str, Any]
) -> dict[str, Any]:
    """`row` of optimizer step `step` (0-based) with where this run started (its first row)
    and the held-out loss when it is evaluated after this step (collective)."""
    if step == st.start:
        row["run_start"] = st.mark
    if st.held_out is not None and _should_eval(res.run, step + 1):
        row["eval_loss"] = _evaluate(st.runner, res, groups, st.held_out)
        row["eval_perplexity"] = math.exp(min(row["eval_loss"], 50.0))
    return row


def _train(
    res: Resolved,
    groups: ProcessGroups,
    resume: str | None,
    stop: StopRequest | None,
    job_id: str | None,
) -> list[dict[str, Any]]:
    run = res.run
    st = _setup(res, groups, resume)
    engine = st.runner.engine
    flops = (flops_per_token(res.model, run.model.seq_len), _peak(res, engine))
    reporter = Reporter(res) if dist.get_rank() == 0 else None
    if reporter:
        _log_start(res, st)
    rows: list[dict[str, Any]] = []
    last_saved = None
    stop = stop or StopRequest()  # (not entered: no signal handlers, but `ask` works)
    outputs = _LogDir(reporter, stop, run.log.dir)
    saver = Saver(res, groups, st.root, st.corpus, job_id)  # checkpoint.async: in the background
    try:
        for step in range(st.start, run.train.steps):
            row, numbers, stopping = _step(res, groups, st, step, flops, stop)
            rows.append(_marked(res, groups, st, step, row))
            outputs.write(step + 1, row, numbers)
            if _should_save(run, step + 1) or stopping:
                with stop.saving():  # a second Ctrl-C waits for the commit
                    last_saved = saver.save(engine, step + 1) or last_saved
            if stopping:
                row["stopped"] = True
                if reporter:
                    why = (stop and stop.signal_name) or "another rank"
                    log.warning(
                        "stopped at step %d on request (%s); relaunch to resume", step + 1, why
                    )
                break
        with stop.saving():  # every rank's asynchronous save in flight committed, or failed
            last_saved = saver.finish(engine) or last_saved
        if (res.ds.get("comms_logger") or {}).get("enabled"):
            _comms_summary(st.runner, run.log.dir)
        exported = _export(res, groups, st, stopped=bool(rows and rows[-1].get("stopped")))
        outputs.check(last_saved)  # rank 0: a log.dir it could not write ends the run here
        if reporter:  # the closing line: where everything the run wrote is
            log.info("%s", reporter.closing_line(last_saved, st.root, exported))
    finally:
        outputs.close()
        saver.close()  # (after an exception too: the write in flight finishes first)
        engine.destroy()
    return rows


def _export(res: Resolved, groups: ProcessGroups, st: _Stage, stopped: bool) -> str | None:
    """`checkpoint.export_hf` at the end of a completed run (collective): where the model went,
    or None. A run stopped early says it did not export (not skipped silently)."""
    path, engine = res.run.checkpoint.export_hf, st.runner.engine
    if not path:
        return None
    if stopped:
        if dist.get_rank() == 0:
            log.warning("%s", export_skipped(path))
        return None
    origin = ExportOrigin(st.root, res.run.train.steps)
    said = export_hf(engine.module, path, res.model, groups.data, origin, engine.device)
    if said:  # rank 0: says where the model went
        log.info("%s", said)
    return path


class _LogDir:
    """Rank 0's writes to log.dir as a run goes (metrics.jsonl, the monitors): a write the disk
    refuses (ENOSPC: a full disk) asks every rank to stop at the next step — through the stop
    flag of the step's all-gather, as a SIGTERM would — where a checkpoint is saved (elsewhere,
    or here if there is room), and the run then ends in one line (`WriteFailed`, exit 1)
    instead of a traceback on rank 0 and peers that lost it mid-collective."""

    def __init__(self, reporter: Reporter | None, stop: StopRequest, log_dir: str) -> None:
        self.reporter, self.stop, self.log_dir = reporter, stop, log_dir
        self.failed: tuple[int, OSError] | None = None  # (step, what the disk said)

    def write(self, step: int, row: dict[str, Any], numbers: dict[str, Any]) -> None:
        if self.reporter is None or self.failed:
            return
        try:
            self.reporter.write(row, numbers)
        except OSError as e:
            self.failed = (step, e)
            self.stop.ask("log.dir could not be written")

    def check(self, saved: str | None) -> None:
        if self.failed is None:
            return
        step, e = self.failed
        where = f" ({e.filename})" if e.filename else ""
        kept = f"checkpoint {saved} is the last saved" if saved else "no checkpoint was saved"
        raise WriteFailed(
            f"log.dir {self.log_dir}: cannot write the metrics of step {step} "
            f"({e.strerror or e}){where}; stopped, {kept}; free space there, "
            "then relaunch to resume"
        ) from e

    def close(self) -> None:
        if self.reporter is not None:
            with contextlib.suppress(OSError):  # buffered rows a full disk still refuses
                self.reporter.close()


def export_skipped(path: str) -> str:
    """What a run stopped before `train.steps` says of its `checkpoint.export_hf` (no export,
    and no directory made for one)."""
    return (
        f"checkpoint.export_hf: not exported to {path} (stopped before train.steps; the "
        "export is written when a run completes): resume to finish the run, or export the "
        "saved checkpoint with dsnd ckpt export"
    )


def _comms_summary(runner: StageRunner, log_dir: str) -> None:
    """DeepSpeed's comms_logger summary at the end of a run (collective), as a DeepSpeed training
    script prints it with `deepspeed.comm.log_summary()`: rank 0 prints the table to its log and
    writes the numbers to ``log.dir/comms_summary.json``. It counts the collectives DeepSpeed
    runs (ZeRO's reductions and gathers), not dsnd's pipeline sends."""
    summary = runner.comms_summary()
    if dist.get_rank() == 0 and summary is not None:
        path = os.path.join(log_dir, "comms_summary.json")
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1, default=str)
        except OSError as e:  # a full log.dir: said in a line, the run's end is not lost to it
            log.warning("cannot write %s (%s)", path, e.strerror or e)
            return
        log.info("DeepSpeed's communication summary written to %s", path)
