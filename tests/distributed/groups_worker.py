"""Rank program: dsnd's process groups and mpu against DeepSpeed's PipelineParallelGrid.

Usage (every rank): python tests/distributed/groups_worker.py OUT.json
For each (pp, tp) layout of the world, every rank builds dsnd's groups and then DeepSpeed's grid
(both call `new_group` for every group, in the same order on every rank), reads back the member
ranks of each group with `get_process_group_ranks`, and runs one all_reduce over dsnd's data
group. Rank 0 gathers every rank's findings and writes {"pp,tp": [finding per rank]}.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from dsnd.distributed.groups import build_groups  # noqa: E402
from dsnd.distributed.mpu import Mpu  # noqa: E402
from dsnd.engine.deepspeed_api import pipe_topology  # noqa: E402
from dsnd.topology import Topology  # noqa: E402
from tests.distributed.worker import everyone, this_rank, world, write_json  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]


def ranks_of(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_layout(pp: int, tp: int) -> dict:
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    topo = Topology.from_world(dist.get_world_size(), pp, tp)
    groups = build_groups(topo)
    grid = PipelineParallelGrid(topology=pipe_topology(topo.pp, topo.tp, topo.dp))
    mpu = Mpu(groups)

    # one real collective over dsnd's data group: each member contributes its global rank
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=groups.data)

    return {
        "rank": dist.get_rank(),
        "coord": list(groups.coord),
        "dsnd": {
            "data": ranks_of(groups.data),
            "tensor": ranks_of(groups.tensor),
            "pipe": ranks_of(groups.pipe),
            "model": ranks_of(groups.replica),
            "mpu_data": ranks_of(mpu.get_data_parallel_group()),
            "mpu_model": ranks_of(mpu.get_model_parallel_group()),
            "mpu_pipe": ranks_of(mpu.get_pipe_parallel_group()),
        },
        "grid": {
            "data": ranks_of(grid.get_data_parallel_group()),
            "slice": ranks_of(grid.get_slice_parallel_group()),
            "pipe": ranks_of(grid.get_pipe_parallel_group()),
            "model": ranks_of(grid.get_model_parallel_group()),
            "data_list": list(grid.get_data_parallel_group_ranks()),
        },
        "mpu_answers": {
            "data_rank": mpu.get_data_parallel_rank(),
            "data_size": mpu.get_data_parallel_world_size(),
            "model_rank": mpu.get_model_parallel_rank(),
            "model_size": mpu.get_model_parallel_world_size(),
            "tensor_rank": mpu.get_tensor_model_parallel_rank(),
            "tensor_size": mpu.get_tensor_model_parallel_world_size(),
            "tensor_src": mpu.get_tensor_model_parallel_src_rank(),
            "pipe_rank": mpu.get_pipe_parallel_rank(),
            "pipe_size": mpu.get_pipe_parallel_world_size(),
        },
        "grid_answers": {
            "data_rank": grid.get_data_parallel_rank(),
            "data_size": grid.get_data_parallel_world_size(),
            "slice_rank": grid.get_slice_parallel_rank(),
            "slice_size": grid.get_slice_parallel_world_size(),
            "model_rank": grid.get_model_parallel_rank(),
            "model_size": grid.get_model_parallel_world_size(),
            "pipe_rank": grid.get_pipe_parallel_rank(),
            "pipe_size": grid.get_pipe_parallel_world_size(),
        },
        "data_sum": total.item(),
    }


def check_degrees() -> dict:
    """The groups of the degrees carved out of dp (ep, dp_shard, hpz) at dp=4, and a pp=2
    pipeline's channels (ring included) and tied pair, as `build_groups` made them."""

    def ranks(group) -> list[int] | None:
        return None if group is None else ranks_of(group)

    ep = build_groups(Topology(pp=1, dp=4, tp=1, ep=2))
    hsdp = build_groups(Topology(pp=1, dp=4, tp=1, dp_shard=2))
    hpz = build_groups(Topology(pp=1, dp=4, tp=1, hpz=2))
    pipe = build_groups(Topology(pp=2, dp=2, tp=1), ring=True, ties=[(0, 1), (0, 1)])
    return {
        "expert": ranks(ep.expert),
        "expert_data": ranks(ep.expert_data),
        "ep_shard": ranks(ep.shard),
        "ep_replicate": ranks(ep.replicate),
        "shard": ranks(hsdp.shard),
        "replicate": ranks(hsdp.replicate),
        "zero_data": ranks(hsdp.for_zero().data),
        "data": ranks(hsdp.data),
        "hpz": ranks(hpz.hpz),
        "no_hpz": ranks(ep.hpz),
        "channels": {f"{a}{b}{k}": ranks_of(g) for (a, b, k), g in pipe.channels.items()},
        "pairs": {f"{a}{b}": ranks(g) for (a, b), g in pipe.pairs.items()},
    }


def main(out_path: str) -> None:
    info = this_rank()
    results = {}
    with world(info, timeout_s=60):
        for pp, tp in LAYOUTS:
            results[f"{pp},{tp}"] = everyone(check_layout(pp, tp))
        results["degrees"] = everyone(check_degrees())
    write_json(out_path, results, info.rank)


if __name__ == "__main__":
    main(sys.argv[1])
