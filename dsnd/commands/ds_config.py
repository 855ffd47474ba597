"""``dsnd ds-config check | explain FILE``: what dsnd does with a DeepSpeed JSON, before any run.

`check` resolves the JSON as a run would (with the run YAML given, or the default one, for
`--nprocs` ranks) and prints, per top-level section of the file, whether it is used as written,
filled in (``"auto"``, a missing optimizer or scheduler), or ignored; every problem at once
(exit 2) otherwise. `explain` adds what the resolved JSON means for the run: batch math,
precision, ZeRO stage, offload targets and the model-state bytes per rank they imply.
"""

from __future__ import annotations

import argparse
import os

from dsnd.config.deepspeed_json import load_json
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.engine.optimizers import state_bytes
from dsnd.plan.memory import model_state_bytes

NOTE_SECTIONS = ("optimizer", "scheduler")  # notes about a section missing from the file


def _resolved(args: argparse.Namespace) -> Resolved:
    sets = [f"deepspeed={os.path.abspath(args.file)}", *args.sets]
    return resolve(load(args.config, sets), args.nprocs)


def section_report(user: dict, notes: list[str]) -> list[str]:
    """One line per top-level key of the user's file (and per section dsnd added): "used as
    written", or the notes on how it was filled in or why it is ignored (each note once, under
    the first key it names)."""
    lines, shown = [], set()
    for key in list(user) + [k for k in NOTE_SECTIONS if k not in user]:
        about = [n for n in notes if key in _keys_of(n)]
        if not about:
            lines.append(f"  {key}: used as written")
        lines += [f"  {n}" for n in about if n not in shown]
        shown.update(about)
    return lines


def _keys_of(note: str) -> set[str]:
    """The top-level keys a note is about: ``"bf16, fp16: ..."`` -> {bf16, fp16}."""
    return {item.split(".")[0] for item in note.split(":")[0].split(", ")}


def run_check(args: argparse.Namespace) -> int:
    res = _resolved(args)
    print(f"{args.file}: dsnd will run it ({args.nprocs} rank{'s' * (args.nprocs > 1)})")
    for line in section_report(load_json(args.file), res.ds_notes):
        print(line)
    return 0


def explain_lines(res: Resolved) -> list[str]:
    ds, t, b = res.ds, res.topology, res.batch
    zero = ds.get("zero_optimization") or {}
    stage = res.plan.zero_stage
    bf16 = bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled"))
    offload = {key: (zero.get(key) or {}).get("device", "none")
               for key in ("offload_optimizer", "offload_param")}  # fmt: skip
    offloaded = stage > 0 and offload["offload_optimizer"] in ("cpu", "nvme")
    optimizer, per_param = state_bytes(ds["optimizer"], offloaded)
    context, ranks, shards = "", "data-parallel ranks", t.dp * t.cp
    dp_shard = res.run.parallel.dp_shard
    if stage == 3 and dp_shard and dp_shard != t.dp:  # HSDP: ZeRO-3 within groups of dp_shard
        ranks, shards = f"data-parallel ranks in groups of {dp_shard} (parallel.dp_shard)", dp_shard
    elif t.cp > 1:
        context = f", cp={t.cp}: context-parallel ranks share their samples"
        ranks = f"data x context-parallel ranks ({t.dp} x {t.cp})"
    lines = [
        f"batch: train_batch_size {b.train} = micro {b.micro} x gradient_accumulation_steps "
        f"{b.gas} x dp {t.dp} (pp={t.pp}, tp={t.tp}{context})",
        f"precision: {'bf16 parameters and gradients, fp32 master weights' if bf16 else 'fp32'}",
        f"ZeRO-{stage} over each stage's {t.dp * t.cp} {ranks}; offload: optimizer "
        f"{offload['offload_optimizer']}, parameters {offload['offload_param']}",
        f"optimizer {ds['optimizer']['type']} {ds['optimizer'].get('params', {})} (DeepSpeed "
        f"builds {optimizer}: {per_param} B of state per parameter); scheduler "
        f"{(ds.get('scheduler') or {}).get('type', 'none')}",
        "model-state bytes per rank (formula: parameters, gradients, fp32 master, optimizer "
        "state; activations and buffers not included):",
    ]
    counts = res.plan.stage_parameters(res.model)
    for s, psi in enumerate(counts):
        where = model_state_bytes(stage, psi // t.tp, shards, bf16,
                                  offload["offload_optimizer"] == "cpu",
                                  offload["offload_param"] == "cpu", per_param)  # fmt: skip
        device = sum(where["device"].values()) / 2**20
        cpu = sum(where["cpu"].values()) / 2**20
        lines.append(f"  stage {s}: {psi:,} parameters{f' / tp {t.tp}' * (t.tp > 1)}: "
                     f"{device:.1f} MiB on the device, {cpu:.1f} MiB in CPU memory")  # fmt: skip
    return lines


def run_explain(args: argparse.Namespace) -> int:
    run_check(args)
    for line in explain_lines(_resolved(args)):
        print(line)
    return 0
