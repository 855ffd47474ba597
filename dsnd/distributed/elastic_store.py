"""A fresh store for each start of a torchrun job's workers.

torchrun's c10d rendezvous (torch 2.13) gives its workers the address of a TCPStore that the
agent of node 0 serves (TORCHELASTIC_USE_AGENT_STORE=True), and keeps that one store for the
whole job. After a restart the new workers would find the keys the previous attempt wrote there,
and gloo would connect to the dead workers' addresses ("Gloo connectFullMesh failed ...
Connection refused"). No variable torchrun sets tells the attempts apart consistently:
TORCHELASTIC_RESTART_COUNT counts one agent's restarts, and an agent that restarts because
another node rejoined does not count it.

So rank 0 serves a new store for the process group and publishes its port, with a random token,
in the agent's store; every other rank takes a published port only once the store behind it
answers with that token. torchrun stops every worker of an attempt before the next one starts,
so a stale entry names a store that no longer answers (or answers another token). torch offers
no such exchange, hence this one.
"""

from __future__ import annotations

import datetime
import socket
import time
import uuid

import torch.distributed as dist

PUBLISHED = "dsnd/process_group_store"  # "<port> <token>", in the agent's store
TOKEN = "dsnd/token"  # the token, in rank 0's own store
PROBE = datetime.timedelta(seconds=2)  # how long a rank waits for one published store to answer


def own_store(addr: str, token: str, port: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store at addr:port if it answers with `token` (then with `timeout` for its calls),
    else None."""
    try:  # TCPStore would retry a refused port for all of PROBE, printing a trace each time
        socket.create_connection((addr, port), timeout=PROBE.total_seconds()).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=PROBE)
        if store.get(TOKEN).decode() != token:
            return None
    except RuntimeError:  # refused, closed or silent: torch raises DistError, a RuntimeError
        return None
    store.set_timeout(timeout)
    return store


def process_group_store(
    addr: str, agent_port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    """The store this attempt's process group starts from: served by rank 0 (on `addr`, the
    host torchrun named in MASTER_ADDR) and found through the agent's store at addr:agent_port.
    RuntimeError ("timed out ...") when rank 0's store does not answer within `timeout`."""
    agent = dist.TCPStore(addr, agent_port, is_master=False, timeout=timeout)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(
            addr, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        store.set(TOKEN, token)
        agent.set(PUBLISHED, f"{store.port} {token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, token = agent.get(PUBLISHED).decode().split()  # waits for the first attempt's
        store = own_store(addr, token, int(port), timeout)
        if store is not None:
            return store
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"timed out after {timeout.total_seconds():.0f} s waiting for "
                f"rank 0's process-group store on {addr}"
            )
        time.sleep(0.2)
