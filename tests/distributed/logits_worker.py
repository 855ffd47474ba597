"""Rank program: the logits of dsnd's forward-only path on pp x tp ranks, from a user's model
directory (`model.init_from`), for `test_pipeline_logits_equal_transformers`.

Usage (every rank): python tests/distributed/logits_worker.py OUT.json CASES.json
CASES.json: [{"name", "dir", "sets"}]. Each case builds this rank's stage exactly as training
does (`build_stage`, then the directory's weights with `load_hf_stage`), runs a fixed batch of
ids through stage 0, sends the hidden states to stage 1 (plain point-to-point), and the last
stage gathers its vocabulary-parallel logits over the tensor-parallel group. Rank 0 of the last
stage writes {name: logits as nested lists}.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from dsnd.config.load import load  # noqa: E402
from dsnd.config.resolve import resolve  # noqa: E402
from dsnd.distributed.groups import run_groups  # noqa: E402
from dsnd.model.hf_io import load_hf_stage  # noqa: E402
from dsnd.pipeline.stage import build_stage  # noqa: E402
from dsnd.tp import gather_from_tp  # noqa: E402
from tests.distributed.worker import this_rank, world, write_json  # noqa: E402

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits(res, groups) -> torch.Tensor | None:
    stack = build_stage(res, groups).eval()
    load_hf_stage(stack, res.run.model.init_from, res.model)
    topo, coord = res.topology, groups.coord
    sp = res.run.parallel.sequence_parallel and topo.tp > 1
    if coord.pp == 0:
        x = stack(IDS)
    else:
        seq = IDS.shape[1] // (topo.tp if sp else 1)
        x = torch.empty(IDS.shape[0], seq, res.model.hidden_size)
        dist.recv(x, src=topo.rank(coord.pp - 1, coord.dp, coord.tp))
        x = stack(x)
    if coord.pp < topo.pp - 1:
        dist.send(x.contiguous(), dst=topo.rank(coord.pp + 1, coord.dp, coord.tp))
        return None
    if topo.tp > 1:
        x = gather_from_tp(x, groups.tensor, -1)[..., : res.model.vocab_size]
    return x


def main(out_path: str, cases_path: str) -> None:
    info = this_rank()
    with open(cases_path) as f:
        cases = json.load(f)
    resolved = [resolve(load(None, c["sets"]), info.world_size) for c in cases]
    results = {}
    with world(info, timeout_s=120):
        for case, res in zip(cases, resolved, strict=True):
            out = logits(res, run_groups(res))
            if out is not None:
                results[case["name"]] = out.tolist()
    last = resolved[0].topology.rank(resolved[0].topology.pp - 1, 0, 0)
    write_json(out_path, results, info.rank, writer=last)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
