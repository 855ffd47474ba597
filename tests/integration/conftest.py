"""What the launcher tests share: the loopback test cluster (tests/cluster.py), one sshd serving
127.0.0.1 and 127.0.0.2, and the single-process reference losses of its launches."""

from __future__ import annotations

import pytest

from tests.cluster import start_cluster
from tests.integration.test_multihost import STEPS, TIMEOUT
from tests.procs import python_json


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two ssh-reachable "hosts" on this machine; launcher commands need `cluster.env`."""
    c = start_cluster(str(tmp_path_factory.mktemp("cluster")), nhosts=2)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory) -> list[float]:
    """The plain single-process PyTorch run's losses for the run config of the two-host launches
    (tests/integration/test_multihost.py), computed once for every test that compares with it."""
    code = (
        "import json; from dsnd.config.load import load; from dsnd.config.resolve import resolve;"
        "from tests.reference import reference_rows;"
        f"res = resolve(load(None, ['train.steps={STEPS}', 'parallel.pp=1']), 1);"
        "print(json.dumps([r['loss'] for r in reference_rows(res)]))"
    )
    return python_json(code, timeout=TIMEOUT)


ELASTIC_SETS = (
    "train.steps=16",
    "checkpoint.every=2",
    "ds.train_batch_size=12",
    "model.seq_len=1024",  # steps long enough (about a second) for a host to rejoin mid-job
    "model.max_position_embeddings=1024",
    "log.tensorboard=false",
)
"""The run of the elastic tests (test_elastic.py, test_torchrun_elastic.py): global batch 12 on
every layout, micro-batch 2."""


@pytest.fixture(scope="session")
def elastic_reference() -> list[dict]:
    """The plain single-process PyTorch run's rows for ELASTIC_SETS, computed once."""
    code = (
        "import json; from dsnd.config.load import load; from dsnd.config.resolve import resolve;"
        "from tests.reference import reference_rows;"
        f"res = resolve(load(None, [*{list(ELASTIC_SETS)!r}, 'parallel.pp=1']), 1);"
        "print(json.dumps(reference_rows(res)))"
    )
    return python_json(code, timeout=TIMEOUT)
