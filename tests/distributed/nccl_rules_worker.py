"""Rank program: exchanges that gloo completes, for the NCCL-rules replay to judge.

Usage (every rank of 2): python tests/distributed/nccl_rules_worker.py PATTERN
- "posted-ahead": each rank posts a receive from the other, then sends to it, on one group (the
  pipeline's links before they had a group per channel): gloo matches by tag; NCCL runs the
  pair's operations in order on one stream and deadlocks.
- "batched": the same receive and send in one `batch_isend_irecv`: launched together on NCCL.
- "channels": the send on one two-rank group, the receive on another (dsnd's links now).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from tests.distributed.worker import this_rank, world  # noqa: E402


def main(pattern: str) -> None:
    info = this_rank()
    with world(info, timeout_s=60, plain=True):
        me, peer = info.rank, 1 - info.rank
        mine, theirs = torch.full((4,), float(me)), torch.empty(4)
        channels = [dist.new_group([0, 1]), dist.new_group([0, 1])]  # one per direction
        if pattern == "posted-ahead":
            pending = dist.irecv(theirs, peer, tag=1)
            dist.send(mine, peer, tag=1)
            pending.wait()
        elif pattern == "batched":
            ops = [dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        else:
            pending = dist.irecv(theirs, peer, group=channels[peer])
            dist.send(mine, peer, group=channels[me])
            pending.wait()
        assert theirs.tolist() == [float(peer)] * 4, theirs


if __name__ == "__main__":
    main(sys.argv[1])
