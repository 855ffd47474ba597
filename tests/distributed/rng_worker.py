"""Rank program: dropout masks drawn on the replicated and tensor-parallel streams.

Usage (every rank of 4): python tests/distributed/rng_worker.py OUT.json
Topology pp=1 x dp=2 x tp=2. Each rank draws dropout masks outside and inside
`TPRandomState.fork()`, reruns the same draws with a fresh tracker, round-trips `state_dict()`
and checks that a fork leaves the default stream's sequence alone. Rank 0 gathers every rank's
findings and writes [finding per rank] (masks as "0"/"1" strings).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsnd.topology import Topology  # noqa: E402
from dsnd.tp.random import TPRandomState  # noqa: E402
from tests.distributed.worker import everyone, this_rank, world, write_json  # noqa: E402

SEED = 1234
WIDTH = 256  # two equal 256-element masks by chance: 2**-256


def mask() -> str:
    """One dropout mask (p=0.5) from whichever generator is current."""
    kept = F.dropout(torch.ones(WIDTH), p=0.5, training=True) != 0
    return "".join("1" if k else "0" for k in kept.tolist())


def findings(coord) -> dict:
    out: dict = {"coord": list(coord)}
    tracker = TPRandomState(SEED, coord)
    out["seeds"] = [tracker.default_seed, tracker.tp_seed]
    out["outside_a"] = mask()
    with tracker.fork():
        out["inside_1"] = mask()
        out["inside_2"] = mask()  # the tp stream advances within a fork
    out["outside_b"] = mask()
    with tracker.fork():
        out["inside_3"] = mask()  # ... and continues at the next fork

    # the same seed again, without the forks: the default stream runs on undisturbed
    fresh = TPRandomState(SEED, coord)
    out["plain_a"] = mask()
    out["plain_b"] = mask()
    with fresh.fork():
        out["rerun_inside"] = [mask(), mask(), mask()]

    # state_dict round trip, loaded into the same tracker and into one built with another seed
    saved = tracker.state_dict()
    with tracker.fork():
        out["next_inside"] = mask()
    out["next_outside"] = mask()
    with tracker.fork():
        mask()
    mask()
    tracker.load_state_dict(saved)
    with tracker.fork():
        out["restored_inside"] = mask()
    out["restored_outside"] = mask()
    other = TPRandomState(SEED + 1, coord)
    other.load_state_dict(saved)
    with other.fork():
        out["other_inside"] = mask()
    out["other_outside"] = mask()

    # an exception inside a fork still restores the default stream; forks do not nest
    saved = tracker.state_dict()
    try:
        with tracker.fork():
            mask()
            raise ValueError("inside")
    except ValueError:
        pass
    out["after_error"] = mask()
    tracker.load_state_dict(saved)
    out["after_error_expected"] = mask()
    try:
        with tracker.fork(), tracker.fork():
            pass
        out["nested"] = "allowed"
    except RuntimeError as e:
        out["nested"] = str(e)
    return out


def main(out_path: str) -> None:
    info = this_rank()
    # plain gloo, not `init_world`: the tracker needs no DeepSpeed, whose import costs seconds
    with world(info, timeout_s=60, plain=True):
        found = everyone(findings(Topology(pp=1, dp=2, tp=2).coord(dist.get_rank())))
    write_json(out_path, found, info.rank)


if __name__ == "__main__":
    main(sys.argv[1])
