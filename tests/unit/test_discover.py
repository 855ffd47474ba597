"""`dsnd.distributed.discover.discover` on launcher environments (pure: env dicts in,
WorldInfo out)."""

from __future__ import annotations

import pytest

from dsnd.distributed.discover import DEFAULT_PORT, WorldInfo, discover
from dsnd.errors import UserError


def ompi(rank: int, size: int, local: int, local_size: int, **extra: str) -> dict[str, str]:
    """The variables Open MPI 5's mpirun sets in each rank (PMIx ones included)."""
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": "0",
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": "prterun-host-1234@1",
    }
    env.update(extra)
    return env


def mpich(rank: int, size: int, local: int, local_size: int, **extra: str) -> dict[str, str]:
    """MPICH / Intel MPI (Hydra): PMI_* for the world, MPI_LOCAL* for the host."""
    env = {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "MPI_LOCALRANKID": str(local),
        "MPI_LOCALNRANKS": str(local_size),
        "PMI_FD": "6",
        "HYDI_CONTROL_FD": "7",
    }
    env.update(extra)
    return env


# --- env:// (DeepSpeed's launcher, torchrun) -------------------------------------------------


def test_env_launcher_values_taken_as_given():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29611",
    }
    assert discover(env) == WorldInfo(5, 8, 1, "10.0.0.7", 29611, "env")


def test_env_launcher_defaults_address_port_and_local_rank():
    info = discover({"RANK": "2", "WORLD_SIZE": "4"})
    assert (info.rank, info.world_size, info.local_rank) == (2, 4, 0)
    assert (info.master_addr, info.master_port, info.source) == ("127.0.0.1", 29500, "env")
    assert DEFAULT_PORT == 29500


def test_env_launcher_wins_over_mpi_variables():
    # `deepspeed --launcher openmpi` or torchrun under mpirun: the explicit RANK is the truth
    env = ompi(0, 4, 3, 4, RANK="2", WORLD_SIZE="4", LOCAL_RANK="2")
    info = discover(env)
    assert (info.source, info.rank, info.local_rank) == ("env", 2, 2)


# --- Open MPI ------------------------------------------------------------------------------

# mpirun -n 4 on one host under Open MPI 5: local ranks need not follow world-rank order
OMPI5_LOCAL_RANKS = [2, 3, 0, 1]


@pytest.mark.parametrize("rank", range(4))
def test_openmpi_one_host_each_rank_takes_its_own_local_rank(rank):
    local = OMPI5_LOCAL_RANKS[rank]
    info = discover(ompi(rank, 4, local, 4))
    assert info == WorldInfo(rank, 4, local, "127.0.0.1", 29500, "openmpi", all_local=True)


def test_openmpi_one_host_local_ranks_form_a_permutation_not_world_order():
    infos = [discover(ompi(r, 4, OMPI5_LOCAL_RANKS[r], 4)) for r in range(4)]
    assert [i.rank for i in infos] == [0, 1, 2, 3]
    assert [i.local_rank for i in infos] == [2, 3, 0, 1]  # not rank % local_size
    assert {i.master_addr for i in infos} == {"127.0.0.1"}


def test_openmpi_multi_host_leaves_address_to_mpi():
    # 2 hosts x 2 ranks: no shared loopback, rank 0's host must be asked (init does, via MPI)
    info = discover(ompi(3, 4, 1, 2))
    assert (info.rank, info.world_size, info.local_rank) == (3, 4, 1)
    assert info.master_addr == ""
    assert info.all_local is False
    assert info.source == "openmpi"


def test_openmpi_multi_host_honours_master_addr_and_port():
    info = discover(ompi(3, 4, 1, 2, MASTER_ADDR="node-a", MASTER_PORT="31000"))
    assert (info.master_addr, info.master_port, info.all_local) == ("node-a", 31000, False)


def test_openmpi_one_host_honours_master_addr():
    assert discover(ompi(1, 2, 1, 2, MASTER_ADDR="10.1.2.3")).master_addr == "10.1.2.3"


# --- MPICH / Intel MPI ---------------------------------------------------------------------


def test_mpich_one_host():
    info = discover(mpich(2, 4, 0, 4))
    assert info == WorldInfo(2, 4, 0, "127.0.0.1", 29500, "mpich", all_local=True)


def test_mpich_multi_host():
    info = discover(mpich(5, 8, 1, 4, MASTER_PORT="29777"))
    assert (info.rank, info.world_size, info.local_rank) == (5, 8, 1)
    assert (info.master_addr, info.master_port, info.all_local) == ("", 29777, False)
    assert info.source == "mpich"


# --- undecidable from the environment, or no launcher --------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-x@1"},
        {"PMI_FD": "6"},
        {"HYDI_CONTROL_FD": "7"},
        {"OMPI_COMM_WORLD_SIZE": "4"},  # size without a rank
    ],
    ids=["pmix", "pmi-fd", "hydra", "ompi-size-only"],
)
def test_mpi_markers_without_rank_variables_need_mpi4py(env):
    assert discover(env) is None


def test_no_launcher_is_a_world_of_one():
    assert discover({}) == WorldInfo(0, 1, 0, "127.0.0.1", 29500, "single")
    assert discover({"HOME": "/root", "PATH": "/usr/bin"}).world_size == 1


def test_world_of_one_honours_master_port():
    assert discover({"MASTER_PORT": "12345"}).master_port == 12345


# --- malformed values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"RANK": "zero", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "4x"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": ""}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"MASTER_PORT": "29500.5"}, "MASTER_PORT"),
        (ompi(0, 4, 0, 4, OMPI_COMM_WORLD_LOCAL_RANK="n/a"), "OMPI_COMM_WORLD_LOCAL_RANK"),
        (mpich(0, 4, 0, 4, PMI_RANK="?"), "PMI_RANK"),
    ],
)
def test_non_integer_variable_is_a_user_error_naming_it(env, name):
    with pytest.raises(UserError, match=rf"\b{name}=") as err:
        discover(env)
    assert "\n" not in str(err.value)
