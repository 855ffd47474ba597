"""Rank program: parameter bytes a rank holds while and after building its stage under ZeRO-3.

Usage (every rank): python tests/distributed/zero_init_worker.py OUT.json
Builds the llama-tiny stage of pp=1 x dp=WORLD with ds_configs/zero3.json through dsnd's own
`build_stage` (each layer handed to deepspeed.zero.Init over the data-parallel group) and
measures, from the live parameter objects themselves, the bytes materialised on this rank: at
every layer's initialisation (the construction peak) and after construction.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dsnd.model.stack as specs_module  # noqa: E402
from dsnd.config.load import load  # noqa: E402
from dsnd.config.resolve import resolve  # noqa: E402
from dsnd.distributed.groups import run_groups  # noqa: E402
from dsnd.pipeline.stage import build_stage  # noqa: E402
from tests.distributed.worker import this_rank, world, write_json  # noqa: E402


def live_param_bytes() -> int:
    """Bytes held by every parameter alive in this process: a ZeRO-3 parameter's materialised
    data (full only while gathered) plus its own shard; any other (the layer being built,
    before ZeRO takes it) its data. Meta parameters hold nothing."""
    total = 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.nn.Parameter) or obj.is_meta:
            continue
        total += obj.data.numel() * obj.element_size()
        if hasattr(obj, "ds_id"):
            total += obj.ds_tensor.numel() * obj.ds_tensor.element_size()
    return total


def main(out_path: str) -> None:
    info = this_rank()
    res = resolve(load(None, ["deepspeed=ds_configs/zero3.json"]), info.world_size)
    samples = []
    original = specs_module.init_layer

    def measured_init_layer(module, seed, index, std):  # the layer whole, before ZeRO-3
        samples.append(live_param_bytes())
        original(module, seed, index, std)

    specs_module.init_layer = measured_init_layer
    try:
        with world(info, timeout_s=60):
            stack = build_stage(res, run_groups(res))
            params = list(stack.parameters())
            result = {
                "stage_bytes": sum(p.ds_numel * p.element_size() for p in params),
                "largest_layer_bytes": max(
                    sum(p.ds_numel * p.element_size() for p in layer.parameters())
                    for layer in stack.layers.values()
                ),
                "after_build_bytes": live_param_bytes(),
                "construction_peak_bytes": max(samples),
                "all_partitioned": all(p.data.numel() == 0 for p in params),
                "dp": res.topology.dp,
            }
    finally:
        specs_module.init_layer = original
    write_json(f"{out_path}.{info.rank}", result, info.rank, writer=info.rank)


if __name__ == "__main__":
    main(sys.argv[1])
