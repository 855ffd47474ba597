"""What dsnd reads from the environment torchrun gives its workers (`discover`, `job_id`), and the
process-group store of one attempt (`elastic_store`) against a real agent-like TCPStore that
still holds an earlier attempt's entry."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from dsnd.distributed.discover import discover, job_id
from dsnd.distributed.elastic_store import PUBLISHED, TOKEN, process_group_store
from dsnd.launcher.local_ranks import free_port

LOOPBACK = "127.0.0.1"


def torchrun_env(rank: int, agent_store: str | None = "True", **extra: str) -> dict[str, str]:
    """What torch 2.13's torchrun sets in worker `rank` of `--nnodes 2 --nproc-per-node 2`."""
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(rank // 2),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(rank % 2),
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "41234",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "TORCHELASTIC_RUN_ID": "job-7",
    }
    if agent_store is not None:
        env["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    env.update(extra)
    return env


@pytest.mark.parametrize("rank", range(4))
def test_a_torchrun_worker_with_the_agents_store(rank):
    info = discover(torchrun_env(rank))
    assert (info.rank, info.world_size, info.local_rank) == (rank, 4, rank % 2)
    assert (info.master_addr, info.master_port, info.source) == ("127.0.0.1", 41234, "env")
    assert info.agent_store


@pytest.mark.parametrize("value", [None, "False", "true", "1"])
def test_only_torchs_own_true_means_the_agents_store(value):
    """torch compares the variable with str(True); so does dsnd (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    =1 makes torchrun write False, and rank 0 then serves the store itself)."""
    assert not discover(torchrun_env(0, agent_store=value)).agent_store


def test_other_launchers_never_have_the_agents_store():
    plain = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    assert not discover(plain).agent_store
    assert not discover({}).agent_store


def test_the_job_is_torchruns_rendezvous_id_unless_dsnd_named_one():
    assert job_id(torchrun_env(2)) == "job-7"
    assert job_id(torchrun_env(2, TORCHELASTIC_RUN_ID="none")) is None  # torchrun's default
    assert job_id(torchrun_env(2, DSND_JOB_ID="mine")) == "mine"


def _agent() -> tuple[dist.TCPStore, int]:
    port = free_port()
    return dist.TCPStore(LOOPBACK, port, 1, is_master=True, wait_for_workers=False), port


def test_a_stale_entry_of_an_earlier_attempt_is_passed_over():
    """The agent's store still names the previous attempt's rank-0 store (gone: nothing listens
    on its port). Rank 1 starts first, must not take it, and joins rank 0's new store."""
    agent, port = _agent()
    agent.set(PUBLISHED, f"{free_port()} 0123abcd")
    timeout = datetime.timedelta(seconds=30)
    found: dict[str, object] = {}

    def rank1() -> None:
        try:
            found["store"] = process_group_store(LOOPBACK, port, 1, 2, timeout)
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            found["error"] = e

    thread = threading.Thread(target=rank1)
    thread.start()
    try:
        thread.join(0.5)  # rank 1 meanwhile probes the stale entry
        own = process_group_store(LOOPBACK, port, 0, 2, timeout)
        own.set("hello", "from rank 0")
    finally:
        thread.join(60)
    assert "error" not in found, found
    assert found["store"].get("hello") == b"from rank 0"
    assert agent.get(PUBLISHED).decode().split()[0] == str(own.port)


def test_no_rank_0_ends_in_a_timeout_naming_it():
    agent, port = _agent()
    agent.set(PUBLISHED, f"{free_port()} 0123abcd")  # only a stale entry, and nobody serves
    with pytest.raises(RuntimeError, match=r"timed out after 1 s waiting for rank 0's"):
        process_group_store(LOOPBACK, port, 1, 2, datetime.timedelta(seconds=1))


def test_a_live_store_with_another_token_is_not_taken():
    """The previous attempt's port now served by someone else's store: it answers, but not with
    the token published next to the port."""
    agent, port = _agent()
    other = dist.TCPStore(LOOPBACK, 0, 1, is_master=True, wait_for_workers=False)
    other.set(TOKEN, "someone-else")
    agent.set(PUBLISHED, f"{other.port} 0123abcd")
    with pytest.raises(RuntimeError, match="timed out"):
        process_group_store(LOOPBACK, port, 1, 2, datetime.timedelta(seconds=1))
