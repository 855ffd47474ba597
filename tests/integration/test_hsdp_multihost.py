"""Hybrid sharding (`parallel.dp_shard`) across the loopback two-host cluster (tests/cluster.py):
pp=1 x dp=4, ZeRO-3, dp_shard=2, 2 ranks per host, launched with `dsnd launch --hostfile`
through DeepSpeed's pdsh runner. Each host's two ranks are one shard group (parameter
all-gathers stay inside a host; only gradient partitions cross hosts), the losses equal the
single-process reference, and each rank holds ZeRO-3's model states over 2 ranks:
bytes / ((4 + 4 + 4 + 8) * Psi / 2) near 1.
"""

from __future__ import annotations

import json
import os

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.plan.memory import model_state_bytes
from tests.integration.test_multihost import launch_zero3_dp4
from tests.procs import ROOT, last_log_text

HSDP = (
    "parallel.pp=1",
    f"deepspeed={os.path.join(ROOT, 'ds_configs', 'zero3.json')}",
    "parallel.dp_shard=2",
)
"""The run `launch_zero3_dp4` makes of dp_shard=2, as this process resolves it."""


@pytest.mark.launch
def test_hsdp_shards_stay_on_each_host(cluster, tmp_path, reference_losses):
    log_dir = launch_zero3_dp4(cluster, tmp_path, reference_losses, "parallel.dp_shard=2")
    # ranks 0, 1 ran on 127.0.0.1 and ranks 2, 3 on 127.0.0.2 (checked), so each shard group
    # below is one host's ranks and each replica group one rank of each host
    assert [last_log_text(log_dir, rank, "HSDP: ") for rank in range(4)] == [
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [0, 1], gradients averaged with ranks [1, 3]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [0, 2]",
        "ZeRO-3 shards over ranks [2, 3], gradients averaged with ranks [1, 3]",
    ]
    res = resolve(load(None, list(HSDP)), 4)
    psi = res.plan.stage_parameters(res.model)[0]
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        live = max(json.loads(line)["memory_live_bytes"] for line in f)
    ratio = live / sum(model_state_bytes(3, psi, 2, bf16=False)["device"].values())
    print(f"HSDP on 2 hosts: model-state bytes per rank / (20 * {psi} / 2) = {ratio:.3f}")
    assert 0.95 < ratio < 1.10, ratio
