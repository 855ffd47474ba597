"""ZeRO++ hpZ across the loopback two-host cluster (tests/cluster.py): pp=1 x dp=4, ZeRO-3,
`zero_hpz_partition_size: 2`, 2 ranks per host, launched with `dsnd launch --hostfile` through
DeepSpeed's pdsh runner. Each host's two ranks hold the parameters' secondary partition between
them (the point of hpZ: its all-gathers stay inside a node), and the losses equal the
single-process reference.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.test_multihost import (  # noqa: F401 (reference_losses: a fixture)
    check_run,
    launch_on_cluster,
    reference_losses,
)
from tests.procs import ROOT

HPZ = ("parallel.pp=1", f"deepspeed={os.path.join(ROOT, 'ds_configs', 'zero3.json')}",
       "ds.zero_optimization.zero_hpz_partition_size=2")  # fmt: skip


@pytest.mark.launch
def test_hpz_secondary_partition_stays_on_each_host(cluster, tmp_path, reference_losses):  # noqa: F811
    watcher, log_dir = launch_on_cluster(cluster, tmp_path, "pdsh", sets=HPZ)
    # ranks 0, 1 ran on 127.0.0.1 and ranks 2, 3 on 127.0.0.2 (checked here), so each hpZ group
    # below is one host's ranks
    check_run(cluster, watcher, log_dir, reference_losses, first_host_ranks="127.0.0.1")
    groups = []
    for rank in range(4):
        with open(os.path.join(log_dir, "logs", f"rank_{rank:05d}.log")) as f:
            lines = [line for line in f if "ZeRO++ hpZ: " in line]
        groups.append(lines[-1].rsplit("over ranks ", 1)[1].strip())
    assert groups == ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"]
