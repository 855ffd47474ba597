"""``dsnd plan``: every layout a world admits for a model on a device, predicted and ranked
(`dsnd.layout_search`); the best explained; ``--out`` writes it as a run YAML and DeepSpeed JSON
that ``dsnd launch`` takes as is; ``--validate`` runs the top layouts on this machine."""

from __future__ import annotations

import argparse
import json
import math
import os

from dsnd.errors import UserError

GIB = 1024**3
DEFAULT_GLOBAL_BATCH = 1024  # sequences
MAX_DEFAULT_SEQ = 4096
TOP = 5
FIXABLE = (
    "pp",
    "tp",
    "dp",
    "cp",
    "ep",
    "zero_stage",
    "micro_batch",
    "activation_checkpointing",
    "schedule",
)


def fixed(items: list[str]) -> dict[str, str]:
    """``--fix KNOB=VALUE`` items as {knob: value} (values compared as text, lower case)."""
    out = {}
    for item in items:
        knob, sep, value = item.partition("=")
        if not sep or knob not in FIXABLE or not value:
            raise UserError(
                f"--fix {item!r}: expected KNOB=VALUE with KNOB one of {', '.join(FIXABLE)}"
            )
        out[knob] = value.lower()
    return out


def check_out(out: str) -> None:
    """`--out` is written into a new or empty directory only: run.yaml or ds_config.json there
    may be the user's own, which a plan must not overwrite."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: exists and is not a directory")
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(
            f"--out {out}: holds {shown}; dsnd plan writes run.yaml and "
            "ds_config.json into a new or empty directory only (nothing is "
            "overwritten): name another one, or remove what is there"
        )


def _keeps(lay, knobs: dict[str, str]) -> bool:
    return all(str(getattr(lay, k)).lower() == v for k, v in knobs.items())


def global_batch(requested: int | None, world: int) -> int:
    if requested is not None:
        if requested < 1:
            raise UserError(f"--global-batch must be >= 1, got {requested}")
        return requested
    return -(-DEFAULT_GLOBAL_BATCH // world) * world


MAX_WORLD = 2**20
"""The largest --world planned: past a million devices the divisor search alone (every pp, tp,
cp and ep dividing the world) runs for minutes, and no cluster is that large."""
_FIGURES = (
    ("gpu_mem", "--gpu-mem"),
    ("gpu_flops", "--gpu-flops"),
    ("intra_bw", "--intra-bw"),
    ("inter_bw", "--inter-bw"),
)


def check_numbers(args: argparse.Namespace) -> None:
    """UserError for a number dsnd plan cannot plan with, before any search: a world past
    MAX_WORLD, a device figure that is not a finite number > 0 (argparse reads "nan"), a
    --top that would show nothing."""
    if not 1 <= args.world <= MAX_WORLD:
        raise UserError(
            f"--world {args.world} is above {MAX_WORLD} devices (the most dsnd plan searches)"
            if args.world > MAX_WORLD
            else f"--world must be >= 1, got {args.world}"
        )
    for attr, flag in _FIGURES:
        value = getattr(args, attr)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} must be a finite number > 0, got {value}")
    if args.top < 1:
        raise UserError(f"--top must be >= 1, got {args.top} (--all shows every layout)")


def _device(args: argparse.Namespace):
    from dsnd.layout_search import hardware

    if args.gpu is not None and args.gpu.lower() == "cpu":
        return hardware.this_cpu(args.world)
    return hardware.device(
        args.gpu,
        memory_gib=args.gpu_mem,
        tflops=args.gpu_flops,
        intra_gbps=args.intra_bw,
        inter_gbps=args.inter_bw,
        per_node=args.gpus_per_node,
    )


def problem(args: argparse.Namespace):
    """(the model, the planning problem) the arguments describe; UserError for bad ones."""
    from dsnd.engine.deepspeed_api import estimate_model_states
    from dsnd.layout_search.search import Problem
    from dsnd.layout_search.source import load

    check_numbers(args)
    device = _device(args)
    model, shape, split = load(args.model)
    seq = args.seq if args.seq is not None else min(model.max_seq_len, MAX_DEFAULT_SEQ)
    if seq < 1 or seq > model.max_seq_len:
        raise UserError(f"--seq {seq} must be 1..{model.max_seq_len} (the model's positions)")
    bf16 = device.name != "cpu"
    pr = Problem(
        shape,
        split,
        args.world,
        device,
        seq,
        global_batch(args.global_batch, args.world),
        bf16,
        estimate=estimate_model_states,
    )
    return model, pr


def header(pr, count: int, fitting: int) -> list[str]:
    from dsnd.layout_search.render import device_lines

    d = pr.device
    precision = (
        "bf16 mixed precision, Adam (K = 12: fp32 master and two moments)"
        if pr.bf16
        else "fp32, Adam (DeepSpeed's fp32 master and two moments)"
    )
    figures, *fit = device_lines(d, pr.bf16)
    return [
        f"model: {pr.shape.name}; {pr.shape.params / 1e9:.3g}B parameters",
        f"world: {pr.world} x {figures}",
        *fit,
        f"precision: {precision}",
        f"batch: {pr.global_batch} sequences of {pr.seq} tokens per step",
        f"layouts: {count} valid, {fitting} fit in {d.memory_bytes / GIB:.0f} GiB x 0.9",
    ]


def table(layouts) -> list[str]:
    from dsnd.layout_search.render import table as render

    return render(layouts)


def run_plan(args: argparse.Namespace) -> int:
    from dsnd.layout_search import emit
    from dsnd.layout_search.search import explain, plan
    from dsnd.layout_search.zero_sizes import sized_hidden

    if args.out:
        check_out(args.out)
    model, pr = problem(args)
    if args.validate is not None and pr.device.name != "cpu":
        raise UserError("--validate runs the layouts on this machine: plan with --gpu cpu")
    knobs = fixed(args.fix)
    layouts = [x for x in plan(pr) if _keeps(x, knobs)]
    if not layouts:
        raise UserError(
            f"no layout of world {args.world} runs {args.model} "
            f"(seq {pr.seq}, global batch {pr.global_batch}"
            f"{''.join(f', {k}={v}' for k, v in knobs.items())})"
        )
    fitting = [x for x in layouts if x.fits]
    shown = layouts if args.all else fitting[: args.top]
    validation = []
    if args.validate is not None:
        from dsnd.layout_search.validate import validate

        validation = validate(args.model, pr, fitting[: args.validate], args.steps)
    if args.out and fitting:
        preset = args.model in _presets()
        emit.write(
            args.out,
            fitting[0],
            args.model,
            preset,
            pr.seq,
            pr.global_batch,
            pr.bf16,
            sized_hidden(pr.device.name, pr.shape.hidden),
        )
    if args.json:
        print(json.dumps({"layouts": [x.as_json() for x in shown], "validation": validation}))
        return 0
    print("\n".join(header(pr, len(layouts), len(fitting))))
    print("\n".join(table(shown)))
    if fitting:
        print("\n".join(explain(fitting + [x for x in layouts if not x.fits])))
    else:
        print(
            f"nothing fits: the smallest needs {min(x.total_bytes for x in layouts) / GIB:.1f} "
            "GiB per device"
        )
    for row in validation:
        print(
            f"validate {row['layout']}: memory predicted/measured {row['memory_ratio']:.3f}, "
            f"time {row['time_ratio']:.3f}"
        )
    if args.out and fitting:
        print(
            f"wrote {args.out}/run.yaml and ds_config.json: dsnd launch --config "
            f"{args.out}/run.yaml --nprocs {args.world} (or --hostfile)"
        )
    return 0


def _presets() -> list[str]:
    from dsnd.model.source import presets

    return presets()
