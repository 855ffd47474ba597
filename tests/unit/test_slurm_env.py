"""Slurm's variables (as srun and sbatch 22.05 set them, recorded on this machine's test Slurm)
read by `dsnd.distributed.slurm` and `discover`: pure, env dicts in, worlds out."""

from __future__ import annotations

import pytest

from dsnd.distributed.discover import WorldInfo, discover
from dsnd.distributed.slurm import (
    derived_port,
    expand_hostlist,
    expand_tasks_per_node,
    slurm_world,
)
from dsnd.errors import UserError


def srun_task(rank: int, local: int, **extra: str) -> dict[str, str]:
    """A task of `srun -N2 --ntasks-per-node=2` in job 4711 (the variables that matter)."""
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_JOBID": "4711",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": str(rank // 2),
    }
    env.update(extra)
    return env


BATCH_SCRIPT = {
    "SLURM_JOB_ID": "4711",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
        ("gpu[07-10]", ["gpu07", "gpu08", "gpu09", "gpu10"]),
        ("a[1-2,5],b3", ["a1", "a2", "a5", "b3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("x,y[0-1],z", ["x", "y0", "y1", "z"]),
    ],
)
def test_hostlist_expands_like_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "n[1-]"])
def test_bad_hostlist_is_refused(text):
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(text)


def test_tasks_per_node_syntax():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="x3"):
        expand_tasks_per_node("2(x3")


def test_srun_task_world_rendezvous_on_the_first_node_at_a_job_derived_port():
    infos = [discover(srun_task(r, r % 2)) for r in range(4)]
    assert infos[3] == WorldInfo(3, 4, 1, "gpu07", 15000 + 4711, "slurm", False)
    assert {(i.master_addr, i.master_port) for i in infos} == {("gpu07", 19711)}
    assert [i.local_rank for i in infos] == [0, 1, 0, 1]


def test_two_jobs_on_one_node_get_different_ports_and_master_variables_win():
    assert derived_port("4711") != derived_port("4712")
    assert 15000 <= derived_port("99999999") < 25000
    info = discover(srun_task(0, 0, MASTER_ADDR="10.1.1.1", MASTER_PORT="29999"))
    assert (info.master_addr, info.master_port) == ("10.1.1.1", 29999)


def test_one_node_step_is_all_local_and_step_values_beat_the_allocation():
    env = srun_task(
        1, 1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="gpu08", SLURM_STEP_NUM_NODES="1"
    )
    assert discover(env) == WorldInfo(1, 2, 1, "gpu08", 19711, "slurm", True)


def test_batch_script_outside_a_step_is_refused_naming_srun():
    with pytest.raises(UserError, match=r"outside a job step \(SLURM_NTASKS=4.*srun"):
        discover(BATCH_SCRIPT)
    # a one-task batch job runs dsnd train itself: a world of one
    assert discover({**BATCH_SCRIPT, "SLURM_NTASKS": "1"}).source == "single"


def test_other_launchers_inside_an_allocation_are_theirs():
    # torchrun or dsnd launch inside sbatch: RANK & co. win
    env = {**BATCH_SCRIPT, "RANK": "2", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}
    assert discover(env).source == "env"
    # mpirun inside an allocation: its rank inherits the daemon's step variables
    ompi = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert discover({**srun_task(1, 0), **ompi}).rank == 5
    assert discover({**BATCH_SCRIPT, **ompi}).source == "openmpi"
    # MPICH's Hydra under Slurm: PMI says rank 6, the proxy's step says 1 -> MPI's
    hydra = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "PMI_FD": "5"}
    assert discover({**srun_task(1, 0), **hydra}).source == "mpich"


def test_srun_mpi_pmi2_takes_the_local_rank_from_slurm():
    pmi2 = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "13", "PMI_JOBID": "4711.0"}
    info = discover({**srun_task(3, 1), **pmi2})
    assert (info.source, info.rank, info.local_rank) == ("slurm", 3, 1)


@pytest.mark.parametrize("missing", ["SLURM_LOCALID", "SLURM_JOB_ID"])
def test_a_missing_slurm_variable_is_named(missing):
    env = srun_task(0, 0)
    del env[missing]
    with pytest.raises(UserError, match=missing):
        slurm_world(env)


def test_non_integer_is_named():
    with pytest.raises(UserError, match="SLURM_PROCID='x'"):
        slurm_world(srun_task(0, 0, SLURM_PROCID="x"))
