"""ZeRO++ hpZ across the loopback two-host cluster (tests/cluster.py): pp=1 x dp=4, ZeRO-3,
`zero_hpz_partition_size: 2`, 2 ranks per host, launched with `dsnd launch --hostfile` through
DeepSpeed's pdsh runner. Each host's two ranks hold the parameters' secondary partition between
them (the point of hpZ: its all-gathers stay inside a node), and the losses equal the
single-process reference.
"""

from __future__ import annotations

import pytest

from tests.integration.test_multihost import launch_zero3_dp4
from tests.procs import last_log_text


@pytest.mark.launch
def test_hpz_secondary_partition_stays_on_each_host(cluster, tmp_path, reference_losses):
    log_dir = launch_zero3_dp4(
        cluster, tmp_path, reference_losses, "ds.zero_optimization.zero_hpz_partition_size=2"
    )
    # ranks 0, 1 ran on 127.0.0.1 and ranks 2, 3 on 127.0.0.2 (checked), so each hpZ group
    # below is one host's ranks
    hpz = [last_log_text(log_dir, rank, "ZeRO++ hpZ: ") for rank in range(4)]
    groups = [text.rsplit("over ranks ", 1)[1] for text in hpz]
    assert groups == ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"]
