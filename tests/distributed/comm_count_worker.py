"""Rank program: what `dsnd.bench.comm_count` records for collectives issued every way dsnd and
DeepSpeed issue them.

Usage (2 ranks): python tests/distributed/comm_count_worker.py OUT.json
Inside one counter: torch.distributed calls on the world and on a subgroup, `deepspeed.comm`
calls (whose all-gather and reduce-scatter DeepSpeed looked up once, at init), point-to-point
messages (plain and batched), and an all-reduce issued by autograd in backward (dsnd's f
operator). After the counter's block, one more all-reduce that must not be counted. Rank 0
writes every rank's records and each group's ranks and name.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from dsnd.bench.comm_count import count_comm  # noqa: E402
from dsnd.tp.mappings import copy_to_tp  # noqa: E402
from tests.distributed.worker import everyone, this_rank, world, write_json  # noqa: E402


def issue(sub: dist.ProcessGroup) -> None:
    import deepspeed.comm as ds_comm

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    x = torch.ones(8)  # 32 bytes
    dist.all_reduce(x)
    out = torch.empty(16)
    dist.all_gather_into_tensor(out, x, group=sub)
    dist.reduce_scatter_tensor(torch.empty(4), x)
    dist.all_gather([torch.empty(8), torch.empty(8)], x, group=sub)
    dist.broadcast(x, src=0)
    ds_comm.all_gather_into_tensor(out, x)
    ds_comm.reduce_scatter_tensor(torch.empty(4), x)
    ds_comm.all_reduce(torch.ones(2, dtype=torch.float64), group=sub)
    if rank == 0:
        dist.send(torch.ones(3), dst=peer)
    else:
        dist.recv(torch.empty(3), src=peer)
    ops = [
        dist.P2POp(dist.isend, torch.ones(5), peer),
        dist.P2POp(dist.irecv, torch.empty(5), peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    leaf = torch.ones(6, requires_grad=True)
    copy_to_tp(leaf, sub).sum().backward()  # f: all-reduce of the gradient, in backward


def main(out_path: str) -> None:
    info = this_rank()
    with world(info, timeout_s=60):
        sub = dist.new_group([0, 1])
        with count_comm() as counter:
            counter.label = "inside"
            issue(sub)
        dist.all_reduce(torch.ones(1))  # after the block: not counted
        mine = [vars(c) | {"sent": c.sent} for c in counter.calls]
        groups = {
            "world": [dist.group.WORLD.group_name, dist.get_process_group_ranks(None)],
            "sub": [sub.group_name, dist.get_process_group_ranks(sub)],
        }
        calls = everyone(mine)
    write_json(out_path, {"calls": calls, "groups": groups}, info.rank)


if __name__ == "__main__":
    main(sys.argv[1])
