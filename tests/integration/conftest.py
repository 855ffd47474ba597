"""The loopback test cluster (tests/cluster.py): one sshd serving 127.0.0.1 and 127.0.0.2."""

from __future__ import annotations

import pytest

from tests.cluster import start_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two ssh-reachable "hosts" on this machine; launcher commands need `cluster.env`."""
    c = start_cluster(str(tmp_path_factory.mktemp("cluster")), nhosts=2)
    yield c
    c.stop()
