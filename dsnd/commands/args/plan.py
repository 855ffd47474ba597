"""``dsnd plan``: the model, the world and its devices, and what to show, write or validate."""

from __future__ import annotations

import argparse

from dsnd.commands.plan import DEFAULT_GLOBAL_BATCH, FIXABLE, MAX_DEFAULT_SEQ, TOP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama-tiny",
        help="a preset, transformers model directory or config.json",
    )
    p.add_argument("--world", type=int, required=True, help="devices (ranks) in all")
    p.add_argument(
        "--gpu",
        help="a device by name: a100, a100-40g, h100, h200, or cpu (this "
        "machine, measured; what --validate runs on)",
    )
    p.add_argument("--gpu-mem", type=float, help="device memory, GiB")
    p.add_argument("--gpu-flops", type=float, help="device peak, TFLOP/s (bf16 dense)")
    p.add_argument("--intra-bw", type=float, help="GB/s per direction between a node's devices")
    p.add_argument("--inter-bw", type=float, help="GB/s per direction per device between nodes")
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default 8)")
    p.add_argument(
        "--seq",
        type=int,
        help="tokens per sequence (default: the model's trained "
        f"length, at most {MAX_DEFAULT_SEQ})",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help=f"sequences per step (default "
        f"{DEFAULT_GLOBAL_BATCH}, or the smallest multiple of --world above "
        "it)",
    )
    p.add_argument("--json", action="store_true", help='one object: {"layouts", "validation"}')
    p.add_argument("--all", action="store_true", help="every layout, those that do not fit too")
    p.add_argument("--top", type=int, default=TOP, help=f"layouts shown (default {TOP})")
    p.add_argument(
        "--out",
        help="write the best layout's run.yaml and ds_config.json into this new or empty directory",
    )
    p.add_argument(
        "--validate",
        type=int,
        nargs="?",
        const=3,
        default=None,
        metavar="N",
        help="run the top N layouts (default 3) here and print predicted / measured",
    )
    p.add_argument("--steps", type=int, default=6, help="with --validate: steps per layout")
    p.add_argument(
        "--fix",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help=f"only layouts with this value (repeatable); knobs: {', '.join(FIXABLE)}",
    )
