"""The NCCL-rules replay on real gloo ranks: the recorder (`tests.nccl_rules.record`) sees what
the ranks issued, and `tests.procs.run_ranks` fails a run that gloo completed but NCCL would
hang on. The patterns are `nccl_rules_worker.py`'s."""

from __future__ import annotations

import pytest

from tests.procs import run_ranks

WORKER = "tests/distributed/nccl_rules_worker.py"


@pytest.mark.dist
def test_a_receive_posted_ahead_of_a_send_on_one_group_fails_the_replay():
    with pytest.raises(AssertionError) as e:
        run_ranks(2, [WORKER, "posted-ahead"], timeout=120)
    message = str(e.value)
    assert "would not run on NCCL (lazy mode)" in message
    # each rank's blocking send waits behind its own receive, first on the pair's stream
    for me, peer in ((0, 1), (1, 0)):
        assert (
            f"rank {me} never gets past: wait for rank {me} op 1 send peer {peer} on group 0 "
            "(16 B torch.float32) at nccl_rules_worker.py:"
        ) in message
        assert f"never completes: rank {me} op 0 recv peer {peer} on group 0" in message


@pytest.mark.dist
@pytest.mark.parametrize("pattern", ["batched", "channels"])
def test_the_same_exchange_batched_or_on_a_group_per_channel_passes(pattern):
    run_ranks(2, [WORKER, pattern], timeout=120)
