"""dsnd under a real Slurm (tests/slurm.py: munged, slurmctld, a slurmd at 127.0.0.1 and one at
127.0.0.2), pp=2 x dp=2 at ZeRO-3, llama-tiny, two tasks per node:

- `dsnd launch --launcher slurm --hostfile` builds the srun line; srun starts 2 tasks on each
  node; the losses equal the plain single-process PyTorch reference within 1e-4;
- launch/sbatch_train.sh as users submit it, its ranks finding rank, world, rendezvous host and
  port in Slurm's variables alone; at step 3 the job's batch script gets the time-limit signal
  (`scancel --batch --signal=USR1`, what its `#SBATCH --signal=B:USR1@300` sends): it sends
  SIGTERM to every task (`scancel --signal=TERM`), every rank stops after the same step, the
  checkpoint of that step is committed, the step exits 0 and the job requeues itself; the
  requeued job (same job id) resumes that checkpoint; two steps later one of its tasks is
  SIGKILLed: srun ends the step, the script requeues the job as a failure (restart 1 of 3), and
  the third attempt resumes the job's own newest checkpoint and finishes; every step any
  attempt ran equals the uninterrupted run's bit for bit;
- SIGTERM to `dsnd launch --launcher slurm` reaches the tasks (not srun, which would end the
  step at once): they save the step they are on and the launch exits 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cluster import environ_of, processes_with_env
from tests.procs import ROOT, assert_same_steps, free_port, metrics_rows, python_json, rank_env
from tests.slurm import start_slurm

STEPS = 12
TAG = "DSND_TEST_RUN"
TIMEOUT = 400
SETS = [
    "parallel.pp=2",
    f"deepspeed={os.path.join(ROOT, 'ds_configs', 'zero3.json')}",
    f"train.steps={STEPS}",
    "checkpoint.every=4",
    "log.tensorboard=false",
    "dist.timeout_s=60",
]
pytestmark = pytest.mark.launch


def _args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_slurm(str(tmp_path_factory.mktemp("slurm")), nhosts=2, cpus=2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    """The plain single-process PyTorch run's losses for the same run config."""
    sets = [s for s in SETS if not s.startswith("parallel.pp")] + ["parallel.pp=1"]
    code = (
        "import json, sys; from dsnd.config.load import load; "
        "from dsnd.config.resolve import resolve; from tests.reference import reference_rows;"
        "res = resolve(load(None, sys.argv[1:]), 1);"
        "print(json.dumps([r['loss'] for r in reference_rows(res)]))"
    )
    return python_json(code, *sets, timeout=TIMEOUT)


def _launch(slurm, tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    log_dir = str(tmp_path / name)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in slurm.hosts))
    argv = [
        sys.executable,
        "-m",
        "dsnd",
        "launch",
        "--launcher",
        "slurm",
        "--hostfile",
        str(hostfile),
        "--master-port",
        str(free_port()),
        *_args([*SETS, f"log.dir={log_dir}"]),
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=rank_env(slurm.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, log_dir


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> tuple[list[dict], str]:
    proc, log_dir = _launch(slurm, tmp_path_factory.mktemp("srun"), "whole")
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out[-4000:] + slurm.log_text()
    return metrics_rows(log_dir), out


def test_srun_pp2_dp2_zero3_across_two_slurm_nodes_equals_the_reference(
    slurm, uninterrupted, reference_losses
):
    rows, out = uninterrupted
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(reference_losses, rel=1e-4)
    # the step ran on both Slurm nodes, two tasks each
    job = next(
        line
        for line in slurm.run("scontrol", "show", "job", "--oneliner").stdout.splitlines()
        if "JobName=dsnd-" in line
    )
    assert "NodeList=127.0.0.[1-2]" in job and "NumTasks=4" in job, job
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job, job


def _wait_rows(log_dir: str, count: int, alive) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(metrics_rows(log_dir)) < count:
        assert alive(), f"the job ended before step {count}"
        assert time.monotonic() < deadline, f"no step {count} in {TIMEOUT} s"
        time.sleep(0.2)


def _kill_task(tag: str, procid: int) -> None:
    """SIGKILL the `dsnd train` task with SLURM_PROCID `procid` of the run tagged `tag`."""
    for pid in processes_with_env(TAG, tag):
        if environ_of(pid).get("SLURM_PROCID") == str(procid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsnd\0train" in f.read():
                    os.kill(pid, signal.SIGKILL)
                    return
    raise AssertionError(f"task {procid} is not running")


def test_sbatch_script_time_limit_save_requeue_and_failure_requeue_continue_exactly(
    slurm, uninterrupted, tmp_path
):
    log_dir, output, tag = tmp_path / "log", tmp_path / "job.out", uuid.uuid4().hex
    # sbatch passes on the environment it is run in, as from a user's shell
    env = rank_env({"DSND_PYTHON": sys.executable, TAG: tag})
    submit = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--time=30",
        f"--output={output}",
        os.path.join(ROOT, "launch", "sbatch_train.sh"),
        *_args([*SETS, f"log.dir={log_dir}"]),
        env=env,
        cwd=tmp_path,
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    queued = ("PENDING", "CONFIGURING", "RUNNING")
    _wait_rows(str(log_dir), 3, lambda: slurm.job(job).get("JobState") in queued)
    # attempt 1: what `#SBATCH --signal=B:USR1@300` sends the script before the time limit
    signalled = slurm.run("scancel", "--batch", "--signal=USR1", job)
    assert signalled.returncode == 0, signalled.stderr
    # requeued, held as long as a job credential lives (tests/slurm.py: 10 s), then run again
    info = slurm.wait_job(job, ("PENDING", "COMPLETED", "FAILED"), TIMEOUT)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", info
    stops = re.findall(r"stopped at step (\d+) on request \(SIGTERM\)", output.read_text())
    assert len(stops) == 1 and 3 <= int(stops[0]) < STEPS - 4, output.read_text()[-4000:]
    stopped = int(stops[0])
    # attempt 2: a task dies (SIGKILL, as by the OOM killer) two steps after resuming
    _wait_rows(str(log_dir), stopped + 2, lambda: slurm.job(job).get("JobState") in queued)
    _kill_task(tag, 3)
    info = slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), TIMEOUT)
    text = output.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), (
        text[-3000:],
        info,
        slurm.log_text(),
    )
    root = log_dir / "checkpoints"
    assert "time limit near; stopping every task after its current step" in text
    assert "saved before the time limit; requeued to continue" in text
    assert f"resumed from {root}/step_{stopped:08d} at step {stopped}" in text
    assert re.search(r"step failed with code \d+; requeued \(restart 1 of 3\)", text), text
    assert (tmp_path / f"dsnd-{job}.failures").read_text() == "1\n"
    assert f"job {job} attempt 3 on 127.0.0.[1-2]" in text
    resumed = [int(n) for n in re.findall(r"resumed from \S+/step_(\d+) at step", text)]
    assert resumed[0] == stopped and len(resumed) == 2, resumed
    # every step any attempt ran equals the uninterrupted run's bit for bit, and all were run
    rows, want = metrics_rows(str(log_dir)), {r["step"]: r for r in uninterrupted[0]}
    assert {r["step"] for r in rows} == set(want) and rows[-1]["step"] == STEPS
    assert_same_steps(rows, [want[r["step"]] for r in rows])


def test_sigterm_to_dsnd_launch_reaches_the_tasks_which_save_and_exit_0(
    slurm, uninterrupted, tmp_path
):
    proc, log_dir = _launch(slurm, tmp_path, "stopped")
    _wait_rows(log_dir, 2, lambda: proc.poll() is None)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out[-4000:]
    rows = metrics_rows(log_dir)
    stopped = rows[-1]["step"]
    assert 2 <= stopped < STEPS, rows
    assert f"stopped at step {stopped} on request (SIGTERM)" in out
    assert open(os.path.join(log_dir, "checkpoints", "latest")).read() == f"step_{stopped:08d}\n"
    assert_same_steps(rows, uninterrupted[0][:stopped])


def test_an_allocation_of_fewer_nodes_gets_its_own_layout(slurm, tmp_path):
    """`sbatch`/`salloc --nodes=1-2` with elastic.enabled: the layout is chosen from the
    allocation Slurm gives, each time (here one node drained, then back): pp=2 x dp=2 on two
    nodes, pp=2 x dp=1 on one, the global batch 12 on both."""
    script = (
        f"{sys.executable} -m dsnd launch --launcher slurm --dry-run --json "
        "--set elastic.enabled=true --set parallel.pp=2 --set ds.train_batch_size=12 "
        f"--set log.dir={tmp_path / 'log'}"
    )

    def layout() -> tuple[int, str]:
        done = slurm.run(
            "salloc",
            "--nodes=1-2",
            "--ntasks-per-node=2",
            "--immediate=20",
            "sh",
            "-c",
            script,
            timeout=120,
            env=rank_env({}),
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout)["world_size"], done.stderr

    slurm.run("scontrol", "update", "nodename=127.0.0.2", "state=drain", "reason=test")
    try:
        world, said = layout()
        assert world == 2 and "2 ranks run pp=2 dp=1" in said, said
        assert "x 6 accumulation x dp 1 = global batch 12" in said, said
    finally:
        slurm.run("scontrol", "update", "nodename=127.0.0.2", "state=resume")
        slurm.wait_idle()
    world, said = layout()
    assert world == 4 and "4 ranks run pp=2 dp=2" in said, said
