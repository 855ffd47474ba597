"""``dsnd ds-config check | explain FILE``: what dsnd does with a DeepSpeed JSON, before any run.

`check` resolves the JSON as a run would (with the run YAML given, or the default one, for
`--nprocs` ranks) and prints, per key of the file (nested keys by their dotted path), whether it
is used as written, filled in (``"auto"``, a missing optimizer or scheduler), without effect in
this run or ignored, and why; every problem at once (exit 2) otherwise. `explain` adds what the
resolved JSON means for the run: batch math, precision, ZeRO stage, offload targets and the
model-state bytes per rank they imply.
"""

from __future__ import annotations

import argparse
import os

from dsnd.config.deepspeed_json import load_json
from dsnd.config.ds_effect import notes as deepspeed_notes
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.config.state_memory import (
    offload_targets,
    optimizer_state,
    stage_state_bytes,
    zero_shards,
)
from dsnd.config.summary import batch_line, precision_line

NOTE_SECTIONS = ("optimizer", "scheduler")  # notes about a section missing from the file


def _resolved(args: argparse.Namespace) -> Resolved:
    sets = [f"deepspeed={os.path.abspath(args.file)}", *args.sets]
    return resolve(load(args.config, sets), args.nprocs)


def section_report(user: dict, notes: list[str]) -> list[str]:
    """One line per key of the user's file, nested keys by their dotted path (and per section
    dsnd added): "used as written", or the notes on how it was filled in, why it has no effect
    or is ignored. A note about a whole section stands for its keys; each note is shown once,
    under the first key it names, and a note naming no key of the file is shown at the end."""
    lines, shown = [], set()

    def report(path: str, about: list[str]) -> None:
        if not about:
            lines.append(f"  {path}: used as written")
        lines.extend(f"  {n}" for n in about if n not in shown)
        shown.update(about)

    for key in list(user) + [k for k in NOTE_SECTIONS if k not in user]:
        whole = [n for n in notes if key in _keys_of(n)]
        value = user.get(key)
        if whole or not isinstance(value, dict) or not value:
            report(key, whole)
            continue
        for path in _leaves(value, key):
            report(
                path,
                [
                    n
                    for n in notes
                    if any(path == k or path.startswith(k + ".") for k in _keys_of(n))
                ],
            )
    lines.extend(f"  {n}" for n in notes if n not in shown)
    return lines


def _leaves(section: dict, prefix: str) -> list[str]:
    """The dotted paths of a section's values that are not themselves non-empty sections."""
    paths = []
    for key, value in section.items():
        path = f"{prefix}.{key}"
        paths += _leaves(value, path) if isinstance(value, dict) and value else [path]
    return paths


def _keys_of(note: str) -> set[str]:
    """The dotted keys a note is about: ``"bf16, fp16: ..."`` -> {bf16, fp16}."""
    return set(note.split(":")[0].split(", "))


def run_check(args: argparse.Namespace) -> int:
    res = _resolved(args)
    print(f"{args.file}: dsnd will run it ({args.nprocs} rank{'s' * (args.nprocs > 1)})")
    for line in section_report(load_json(args.file), res.ds_notes + deepspeed_notes(res.ds)):
        print(line)
    return 0


def explain_lines(res: Resolved) -> list[str]:
    ds, t, b = res.ds, res.topology, res.batch
    stage = res.plan.zero_stage
    offload = offload_targets(ds)
    optimizer, per_param = optimizer_state(res)
    ranks, shards = "data-parallel ranks", zero_shards(res)
    if t.dp_shard:  # HSDP: ZeRO-3 within groups of dp_shard (0: no hybrid sharding)
        ranks = f"data-parallel ranks in groups of {t.dp_shard} (parallel.dp_shard)"
    elif t.cp > 1:
        ranks = f"data x context-parallel ranks ({t.dp} x {t.cp})"
    lines = [
        batch_line(b, t),
        precision_line(ds),
        f"ZeRO-{stage} over each stage's {t.dp * t.cp} {ranks}; offload: optimizer "
        f"{offload['offload_optimizer']}, parameters {offload['offload_param']}",
        f"optimizer {ds['optimizer']['type']} {ds['optimizer'].get('params', {})} (DeepSpeed "
        f"builds {optimizer}: {per_param} B of state per parameter); {_schedule(ds)}",
        "model-state bytes per rank (formula: parameters, gradients, fp32 master, optimizer "
        "state; activations and buffers not included):",
    ]
    ep = t.ep
    if ep > 1:
        lines.append(
            f"  (expert parallel over {ep} ranks: a rank holds 1/{ep} of the routed "
            f"experts, sharded over the {shards // ep} ranks holding the same ones)"
        )
    counts = res.plan.stage_parameters(res.model)
    experts_of = res.plan.stage_experts(res.model)
    for s, where in enumerate(stage_state_bytes(res)):
        psi, experts = counts[s], experts_of[s]
        device = sum(where["device"].values()) / 2**20
        cpu = sum(where["cpu"].values()) / 2**20
        of_which = f" ({experts:,} in routed experts)" if experts else ""
        lines.append(
            f"  stage {s}: {psi:,} parameters{of_which}{f' / tp {t.tp}' * (t.tp > 1)}: "
            f"{device:.1f} MiB on the device, {cpu:.1f} MiB in CPU memory"
        )
    return lines


def _schedule(ds: dict) -> str:
    sched = ds.get("scheduler")
    if sched:
        return f"scheduler {sched['type']} {sched.get('params') or {}}"
    lr = (ds["optimizer"].get("params") or {}).get("lr", "the optimizer's default")
    return f"no scheduler: lr {lr}, constant, as DeepSpeed runs it"


def run_explain(args: argparse.Namespace) -> int:
    run_check(args)
    for line in explain_lines(_resolved(args)):
        print(line)
    return 0


def run(args: argparse.Namespace) -> int:
    """``dsnd ds-config check | explain``."""
    return (run_check if args.ds_command == "check" else run_explain)(args)
