"""`dsnd.cli.main` in-process: dry-run plans, rank tables, and the one-line error contract.

No launcher ever runs: `_run` (the only place a process starts) is replaced by a recorder, so a
check that stopped refusing something shows up as a failed assertion, not as started ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dsnd import cli
from dsnd.commands import launch as launch_cmd
from dsnd.config.load import default_config_path
from dsnd.launcher.supervisor import JobResult

HEADER = ["rank", "host", "local_rank", "pp", "dp", "cp", "tp"]
PACKAGED_DS = os.path.join(os.path.dirname(default_config_path()), "zero0.json")


@pytest.fixture(autouse=True)
def launches(monkeypatch, tmp_path):
    """Record would-be launches instead of starting them; isolate cwd, HOME and the accelerator."""
    started: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(argv, env, forwarded, slurm_step=None):
        started.append((argv, env))
        return 0

    def fake_supervise(launches):
        started.append(([a.argv for a in launches], [a.spec for a in launches]))
        return JobResult([], None, None)

    monkeypatch.setattr(launch_cmd, "_run", fake_run)
    monkeypatch.setattr(launch_cmd, "supervise", fake_supervise)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no stray ~/.deepspeed_env
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return started


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def without_launch_tail(argv: list[str]) -> list[str]:
    """A rank's `dsnd train` arguments less what `dsnd launch` adds to the user's: the default
    relative log.dir made absolute (every attempt writes to the same place) and the job id."""
    assert argv[-2] == "--job-id" and len(argv[-1]) == 24, argv  # 20261201-101741-56e869b1
    tail = ["--set", f"log.dir={os.getcwd()}/runs/dsnd"]
    assert argv[-4:-2] == tail, argv
    return argv[:-4]


def table(text: str) -> tuple[str, list[dict]]:
    """(command line, rows) from a dry run's stdout; every row cell but host as int.
    The dsnd launcher prints an `agent on HOST: ...` line per host between the two; the plan
    (from its `plan:` line on) follows the table."""
    lines = text.rstrip("\n").split("\n")
    at = next(i for i, line in enumerate(lines) if line.split() == HEADER)
    end = next(i for i, line in enumerate(lines) if line.startswith("plan: "))
    command, body = lines[0], lines[at + 1 : end]
    assert all(line.startswith("agent on ") for line in lines[1:at])
    rows = []
    for line in body:
        cells = line.split()
        assert len(cells) == len(HEADER), line
        row = dict(zip(HEADER, cells, strict=True))
        rows.append({k: v if k == "host" else int(v) for k, v in row.items()})
    return command, rows


def expected_rows(host_slots: list[tuple[str, int]], pp: int, dp: int, tp: int) -> list[dict]:
    """Rank order pipe-major, tp fastest; hosts filled in order."""
    placement = [(h, i) for h, n in host_slots for i in range(n)]
    rows = []
    for rank, (host, local) in enumerate(placement):
        p, rest = divmod(rank, dp * tp)
        d, t = divmod(rest, tp)
        rows.append(dict(rank=rank, host=host, local_rank=local, pp=p, dp=d, cp=0, tp=t))
    return rows


def hostfile(tmp_path, text: str, name: str = "hosts") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- dry runs ------------------------------------------------------------------------------------


def test_acceptance_dry_run_pp2_tp2_on_4(capsys, launches):
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        "4",
        "--dry-run",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.tp=2",
        "--launcher",
        "pdsh",
    )
    assert (rc, err) == (0, "")
    command, rows = table(out)
    assert len(rows) == 4
    assert [(r["pp"], r["dp"], r["tp"]) for r in rows] == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
    ]
    assert rows == expected_rows([("localhost", 4)], pp=2, dp=1, tp=2)
    argv = without_launch_tail(command.split())
    port = int(argv[6])  # --nprocs picks a free port unless --master-port is given
    assert 1024 <= port <= 65535
    assert argv[1:] == [
        "--num_gpus",
        "4",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--module",
        "dsnd",
        "train",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.tp=2",
    ]
    assert os.path.basename(command.split()[0]) == "deepspeed"
    assert launches == []


@pytest.mark.parametrize(
    "nprocs, pp, tp",
    [(1, 1, 1), (2, 1, 1), (4, 1, 2), (4, 2, 1), (8, 2, 2), (8, 4, 2)],
)
def test_dry_run_rank_tables(capsys, nprocs, pp, tp):
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        str(nprocs),
        "--dry-run",
        "--set",
        f"parallel.pp={pp}",
        "--set",
        f"parallel.tp={tp}",
    )
    assert (rc, err) == (0, "")
    _, rows = table(out)
    dp = nprocs // (pp * tp)
    assert rows == expected_rows([("localhost", nprocs)], pp, dp, tp)


def test_dry_run_json(capsys):
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        "4",
        "--dry-run",
        "--json",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.tp=2",
        "--master-port",
        "1234",
        "--master-addr",
        "10.1.2.3",
        "--launcher",
        "pdsh",
    )
    assert (rc, err) == (0, "")
    plan = json.loads(out)
    assert set(plan) >= {"command", "ranks"}
    assert plan["world_size"] == 4
    command = plan["command"]
    assert os.path.basename(command[0]) == "deepspeed"
    assert without_launch_tail(command)[1:] == [
        "--num_gpus",
        "4",
        "--master_addr",
        "10.1.2.3",
        "--master_port",
        "1234",
        "--module",
        "dsnd",
        "train",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.tp=2",
    ]
    assert plan["ranks"] == expected_rows([("localhost", 4)], pp=2, dp=1, tp=2)
    assert plan["plan"]["parts"] == [0, 3, 7] and plan["plan"]["schedule"] == "1f1b"
    # stage 0 of 1F1B at 8 micro-batches: one warm-up forward, then F/B pairs, then the step
    assert plan["plan"]["programs"][0][:6] == [
        "F0",
        "send_act0",
        "F1",
        "send_act1",
        "recv_grad0",
        "B0",
    ]
    assert plan["plan"]["programs"][0][-2:] == ["reduce", "step"]
    assert plan["plan"]["bubble_unit_costs"] == pytest.approx(1 / 8)


def test_dry_run_prints_the_plan_with_a_timeline_row_per_stage(capsys):
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        "2",
        "--dry-run",
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.schedule=interleaved-1f1b",
        "--set",
        "parallel.virtual_stages=2",
    )
    assert (rc, err) == (0, "")
    plan = out[out.index("plan: ") :].splitlines()
    assert plan[0] == (
        "plan: pp=2 dp=1 tp=1, ZeRO-0, schedule interleaved-1f1b x 2 chunks, "
        "8 micro-batches per step"
    )
    assert plan[1].startswith("  stage 0: layers 0..1, 3..3;")  # two chunks
    rows = [line for line in plan if line.startswith("  stage ") and "layers" not in line]
    assert [r.split(":")[0] for r in rows] == ["  stage 0", "  stage 1"]
    assert rows[0].split(": ")[1].startswith("FFffF")  # micros 0-1 through chunk 0, then 1
    assert rows[1].split(": ")[1].startswith(".")  # stage 1 waits for the first activation


def test_dry_run_passes_an_absolute_config_path(capsys, tmp_path):
    (tmp_path / "work" / "run.yaml").write_text(f"deepspeed: {PACKAGED_DS}\n")
    rc, out, _ = run(
        capsys, "launch", "--nprocs", "2", "--dry-run", "--json", "--config", "run.yaml"
    )
    assert rc == 0
    command = json.loads(out)["command"]
    assert command[command.index("--config") + 1] == str(tmp_path / "work" / "run.yaml")


def test_hostfile_dry_run_master_addr_is_the_first_host(capsys, tmp_path):
    hf = hostfile(tmp_path, "# two nodes\nnode-b slots=2\nnode-a slots=2  # second\n")
    rc, out, err = run(
        capsys,
        "launch",
        "--hostfile",
        hf,
        "--dry-run",
        "--set",
        "parallel.tp=2",
        "--launcher",
        "pdsh",
    )
    assert (rc, err) == (0, "")
    command, rows = table(out)
    assert rows == expected_rows([("node-b", 2), ("node-a", 2)], pp=1, dp=2, tp=2)
    args = command.split()
    assert args[args.index("--hostfile") + 1] == hf
    assert args[args.index("--master_addr") + 1] == "node-b"
    assert args[args.index("--launcher") + 1] == "pdsh"
    assert "--force_multi" in args


def test_hostfile_include(capsys, tmp_path):
    hf = hostfile(tmp_path, "h1 slots=2\nh2 slots=4\n")
    rc, out, err = run(
        capsys, "launch", "--hostfile", hf, "--include", "h2:1,3", "--dry-run", "--launcher", "pdsh"
    )
    assert (rc, err) == (0, "")
    command, rows = table(out)
    assert rows == expected_rows([("h2", 2)], pp=1, dp=2, tp=1)
    args = command.split()
    assert args[args.index("--include") + 1] == "h2:1,3"
    assert args[args.index("--master_addr") + 1] == "h2"  # the first selected host


def test_hostfile_exclude(capsys, tmp_path):
    hf = hostfile(tmp_path, "h1 slots=2\nh2 slots=4\n")
    rc, out, err = run(
        capsys, "launch", "--hostfile", hf, "--exclude", "h2:2,3", "--dry-run", "--launcher", "pdsh"
    )
    assert (rc, err) == (0, "")
    command, rows = table(out)
    assert rows == expected_rows([("h1", 2), ("h2", 2)], pp=1, dp=4, tp=1)
    args = command.split()
    assert args[args.index("--exclude") + 1] == "h2:2,3"
    assert args[args.index("--master_addr") + 1] == "h1"


def test_hostfile_exclude_changes_the_world_the_batch_is_checked_for(capsys, tmp_path):
    hf = hostfile(tmp_path, "h1 slots=2\nh2 slots=2\n")
    rc, out, err = run(capsys, "launch", "--hostfile", hf, "--exclude", "h2:1", "--dry-run")
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {PACKAGED_DS}: cannot derive gradient_accumulation_steps: "
        "train_batch_size=16 / (train_micro_batch_size_per_gpu=2 * dp=3) does not divide exactly\n"
    )


def test_slurm_dry_run_from_a_hostfile_of_node_names(capsys, tmp_path):
    hf = hostfile(tmp_path, "gpu07 slots=2\ngpu08 slots=2\n")
    rc, out, err = run(
        capsys,
        "launch",
        "--hostfile",
        hf,
        "--launcher",
        "slurm",
        "--dry-run",
        "--set",
        "parallel.pp=2",
        "--master-port",
        "4321",
    )
    assert (rc, err) == (0, "")
    command, rows = table(out)
    assert rows == expected_rows([("gpu07", 2), ("gpu08", 2)], pp=2, dp=2, tp=1)
    args = command.split()
    assert os.path.basename(args[0]) == "srun"
    job = args[-1]
    assert args[1:10] == [
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist=gpu07,gpu08",
        "--distribution=block",
        "--kill-on-bad-exit=1",
        f"--job-name=dsnd-{job}",
        "--export=ALL,MASTER_ADDR=gpu07,MASTER_PORT=4321",
        sys.executable,
    ]


def test_slurm_inside_an_allocation_takes_its_nodes_job_id_and_port(capsys, monkeypatch, launches):
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    rc, out, err = run(
        capsys, "launch", "--launcher", "slurm", "--dry-run", "--json", "--include", "gpu08"
    )
    assert (rc, err) == (0, "")
    plan = json.loads(out)
    assert [(r["host"], r["local_rank"]) for r in plan["ranks"]] == [("gpu08", 0), ("gpu08", 1)]
    command = plan["command"]
    assert command[1:5] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=gpu08"]
    assert "--export=ALL,MASTER_ADDR=gpu08,MASTER_PORT=19711" in command  # 15000 + 4711
    assert command[-2:] == ["--job-id", "4711"]  # a requeue keeps the job's own checkpoints
    # launched for real: srun is run once, its step named for the stop request to find
    rc, out, err = run(capsys, "launch", "--launcher", "slurm", "--max-restarts", "1")
    assert rc == 0 and len(launches) == 1
    assert "--job-name=dsnd-4711" in launches[0][0]


def test_slurm_refuses_uneven_nodes_and_a_missing_allocation(capsys, tmp_path, monkeypatch):
    hf = hostfile(tmp_path, "a slots=3\nb slots=1\n")
    rc, out, err = run(capsys, "launch", "--hostfile", hf, "--launcher", "slurm", "--dry-run")
    assert (rc, out) == (2, "")
    assert err == (
        "dsnd: error: srun starts the same number of tasks on every node; the hosts "
        "have a:3, b:1: select as many slots on each\n"
    )
    for name in ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    rc, out, err = run(capsys, "launch", "--launcher", "slurm", "--dry-run")
    assert (rc, out) == (2, "")
    assert "no SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE" in err and err.count("\n") == 1
    rc, out, err = run(capsys, "launch", "--dry-run")
    assert (rc, err) == (
        2,
        "dsnd: error: dsnd launch needs --nprocs N or --hostfile FILE (or "
        "--launcher slurm inside a Slurm allocation)\n",
    )


@pytest.mark.parametrize("launcher", ["dsnd", "pdsh", "openmpi", "slurm"])
def test_dry_run_refuses_a_hostfile_name_no_host_has(capsys, tmp_path, launcher):
    hf = hostfile(tmp_path, "h1 slots=1\n-oProxyCommand=touch${IFS}x slots=1\n")
    rc, out, err = run(capsys, "launch", "--hostfile", hf, "--launcher", launcher, "--dry-run")
    assert (rc, out) == (2, "")
    assert err == (
        f"dsnd: error: {hf}:2: '-oProxyCommand=touch${{IFS}}x' is not a host name or "
        "IP address: it starts with '-' (ssh, pdsh and mpirun would read an option)\n"
    )


def test_slurm_nprocs_is_one_node(capsys):
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        "2",
        "--launcher",
        "slurm",
        "--dry-run",
        "--json",
        "--master-port",
        "4000",
    )
    assert (rc, err) == (0, "")
    command = json.loads(out)["command"]
    assert command[1:5] == [
        "--nodes=1",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--distribution=block",
    ]


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_hostfile_mpi_dry_run(capsys, tmp_path, flavor):
    hf = hostfile(tmp_path, "h1 slots=2\nh2 slots=2\n")
    rc, out, err = run(
        capsys,
        "launch",
        "--hostfile",
        hf,
        "--launcher",
        flavor,
        "--dry-run",
        "--json",
        "--master-port",
        "4321",
    )
    assert (rc, err) == (0, "")
    plan = json.loads(out)
    command = plan["command"]
    assert os.path.basename(command[0]) == "mpirun"
    assert "h1:2,h2:2" in command
    i = command.index("-m")
    assert command[i - 1 : i + 3] == [sys.executable, "-m", "dsnd", "train"]
    if flavor == "openmpi":
        assert command[1:3] == ["-np", "4"]
        assert "MASTER_ADDR=h1" in command and "MASTER_PORT=4321" in command
    else:
        assert command[1:3] == ["-n", "4"]
        j = command.index("MASTER_ADDR")
        assert command[j - 1 : j + 2] == ["-genv", "MASTER_ADDR", "h1"]
    assert plan["ranks"] == expected_rows([("h1", 2), ("h2", 2)], pp=1, dp=4, tp=1)


def test_launch_without_dry_run_starts_the_launcher_once(capsys, launches, tmp_path):
    (tmp_path / "work" / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\n")
    rc, out, err = run(
        capsys, "launch", "--nprocs", "2", "--set", "train.steps=3", "--launcher", "pdsh"
    )
    assert (rc, out, err) == (0, "", "")
    assert len(launches) == 1
    argv, env = launches[0]
    assert os.path.basename(argv[0]) == "deepspeed"
    argv = without_launch_tail(argv)
    assert argv[1:] == [
        "--num_gpus",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        argv[6],
        "--module",
        "dsnd",
        "train",
        "--set",
        "train.steps=3",
    ]
    assert env["NCCL_DEBUG"] == "INFO"


@pytest.mark.parametrize(
    "extra",
    [["--local_rank=3"], ["--local_rank", "3"], ["--local-rank=1"], ["--local-rank", "0"]],
)
def test_local_rank_argument_is_stripped(capsys, extra):
    rc, out, err = run(capsys, "launch", "--nprocs", "2", "--dry-run", *extra)
    assert (rc, err) == (0, "")
    _, rows = table(out)
    assert len(rows) == 2
    # and anywhere in the argument list, as DeepSpeed's launch.py appends it after the module args
    rc, out, err = run(capsys, *extra, "launch", "--dry-run", "--nprocs", "2")
    assert (rc, err) == (0, "")


def test_strip_local_rank():
    assert cli.strip_local_rank(
        ["train", "--local_rank=3", "--set", "a=1", "--local_rank", "2", "--x=--local_rank=1"]
    ) == ["train", "--set", "a=1", "--x=--local_rank=1"]


def test_version(capsys):
    from dsnd import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"dsnd {__version__}\n"


# ---- every bad input: exit 2, one line, nothing started -----------------------------------------


FILES = {
    "hf_zero": "h1 slots=2\nh2 slots=0\n",
    "hf_4x": "# hosts\nh1 slots=4x\n",
    "hf_dup": "h1 slots=2\nh2 slots=2\n\nh1 slots=2\n",
    "hf_noslots": "h1\n",
    "hf_ok": "h1 slots=2\nh2 slots=2\n",
    "typo.yaml": f"deepspeed: {PACKAGED_DS}\nmodel:\n  seq_len: 32\n  hiden_size: 64\n",
    "bad.yaml": "deepspeed: zero0.json\nmodel: seq_len: 3\n",
    "typo_ds.json": '{"train_batch_szie": 16, "train_micro_batch_size_per_gpu": 2}',
    "typo_ds.yaml": "deepspeed: typo_ds.json\n",
    "work/.deepspeed_env": "A=1\nJUNK\n",
}


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, the exact error line after 'dsnd: error: '), for files in FILES under tmp."""
    hf = {k: str(tmp / f"hf_{k}") for k in ("zero", "4x", "dup", "noslots", "ok")}
    missing = str(tmp / "no_such_hostfile")
    typo_yaml, bad_yaml = str(tmp / "typo.yaml"), str(tmp / "bad.yaml")
    typo_ds_yaml, typo_ds = str(tmp / "typo_ds.yaml"), str(tmp / "typo_ds.json")
    ds = PACKAGED_DS
    L = ["launch", "--nprocs"]
    D = "--dry-run"
    SP = "parallel.sequence_parallel=true"
    return {
        "hostfile slots=0": (
            ["launch", "--hostfile", hf["zero"], D],
            f"{hf['zero']}:2: slots must be a positive integer, got '0'",
        ),
        "hostfile slots=4x": (
            ["launch", "--hostfile", hf["4x"], D],
            f"{hf['4x']}:2: slots must be a positive integer, got '4x'",
        ),
        "hostfile duplicate host": (
            ["launch", "--hostfile", hf["dup"], D],
            f"{hf['dup']}:4: duplicate host 'h1' (first on line 1)",
        ),
        "hostfile without slots": (
            ["launch", "--hostfile", hf["noslots"], D],
            f"{hf['noslots']}:1: expected 'slots=N' after host 'h1'",
        ),
        "missing hostfile": (
            ["launch", "--hostfile", missing, D],
            f"{missing}: hostfile not found",
        ),
        "include unknown host": (
            ["launch", "--hostfile", hf["ok"], "--include", "h9", D],
            "--include: unknown host 'h9'; hostfile has h1, h2",
        ),
        "include with nprocs": (
            [*L, "2", "--include", "h1", D],
            "--include/--exclude need --hostfile",
        ),
        "unknown YAML key": (
            [*L, "2", D, "--config", typo_yaml],
            f"{typo_yaml}:4: unknown key 'model.hiden_size' (did you mean 'hidden_size'?)",
        ),
        "invalid YAML": (
            [*L, "2", D, "--config", bad_yaml],
            f"{bad_yaml}:2: invalid YAML: mapping values are not allowed here",
        ),
        "missing YAML": (
            [*L, "2", D, "--config", str(tmp / "none.yaml")],
            f"{tmp / 'none.yaml'}: cannot read run config: No such file or directory",
        ),
        "unknown ds key in the JSON": (
            [*L, "2", D, "--config", typo_ds_yaml],
            f"{typo_ds}: unknown key 'train_batch_szie' (did you mean 'train_batch_size'?)",
        ),
        "unknown ds key by --set": (
            [*L, "2", D, "--set", "ds.zero_optimization.stgae=1"],
            "--set ds.zero_optimization.stgae=1: zero_optimization: unknown key 'stgae' (did you "
            "mean 'stage'?)",
        ),
        "typo'd --set": (
            [*L, "2", D, "--set", "trian.steps=5"],
            "--set trian.steps=5: unknown key 'trian.steps' (did you mean 'train.steps'?)",
        ),
        "--set without =": (
            [*L, "2", D, "--set", "train.steps"],
            "--set train.steps: expected KEY=VALUE",
        ),
        "--set wrong type": (
            [*L, "2", D, "--set", "train.steps=abc"],
            "--set train.steps=abc: train.steps must be an int, got str 'abc'",
        ),
        "bad batch math (three keys)": (
            [*L, "2", D, "--set", "ds.gradient_accumulation_steps=3"],
            "--set ds.gradient_accumulation_steps=3: train_batch_size=16 != "
            "train_micro_batch_size_per_gpu=2 * gradient_accumulation_steps=3 * dp=2 (= 12)",
        ),
        "bad batch math (inexact)": (
            [*L, "3", D],
            f"{ds}: cannot derive gradient_accumulation_steps: train_batch_size=16 / "
            "(train_micro_batch_size_per_gpu=2 * dp=3) does not divide exactly",
        ),
        "world not divisible": (
            [*L, "6", D, "--set", "parallel.pp=2", "--set", "parallel.tp=2"],
            "world size 6 is not divisible by parallel.pp * parallel.tp = 2 * 2 = 4",
        ),
        "tp does not divide heads": (
            [*L, "8", D, "--set", "parallel.tp=8"],
            "preset llama-tiny: num_heads=4 is not divisible by parallel.tp=8",
        ),
        "tp does not divide kv heads": (
            [*L, "4", D, "--set", "parallel.tp=4"],
            "preset llama-tiny: num_kv_heads=2 is not divisible by parallel.tp=4",
        ),
        "fp16 refused": (
            [*L, "2", D, "--set", "ds.fp16.enabled=true"],
            "--set ds.fp16.enabled=true: fp16 is not supported on this device (DeepSpeed: Type "
            "fp16 is not supported on your device); use bf16 or fp32",
        ),
        "offload without ZeRO": (
            [*L, "2", D, "--set", 'ds.zero_optimization.offload_optimizer={"device": "cpu"}'],
            '--set ds.zero_optimization.offload_optimizer={"device": "cpu"}: '
            "zero_optimization.offload_optimizer.device='cpu' needs zero_optimization.stage 1, 2 "
            "or 3, got 0",
        ),
        "DeepSpeed pipeline refused": (
            [*L, "2", D, "--set", "ds.pipeline.stages=2"],
            "--set ds.pipeline.stages=2: 'pipeline' is refused: dsnd runs its own pipeline "
            "schedule; set parallel.pp in the run YAML",
        ),
        "--nprocs 0": ([*L, "0", D], "--nprocs must be >= 1, got 0"),
        "--nprocs -1": ([*L, "-1"], "--nprocs must be >= 1, got -1"),
        "tp=2, MLP width odd": (
            [*L, "2", D, "--set", "parallel.tp=2", "--set", "model.ffn_size=175"],
            "preset llama-tiny: ffn_size=175 is not divisible by parallel.tp=2",
        ),
        "sequence parallel, odd sequence": (
            [*L, "2", D, "--set", "parallel.tp=2", "--set", "model.seq_len=63", "--set", SP],
            "parallel.sequence_parallel: model.seq_len=63 is not divisible by parallel.tp=2",
        ),
        "bad .deepspeed_env": (
            [*L, "2", D],
            f"{tmp / 'work' / '.deepspeed_env'}:2: expected KEY=VALUE, got 'JUNK'",
        ),
        "no --nprocs or --hostfile": (
            ["launch", D],
            "dsnd launch needs --nprocs N or --hostfile FILE (or --launcher slurm inside a Slurm "
            "allocation)",
        ),
        "--nprocs not a number": (
            [*L, "four", D],
            "argument --nprocs: invalid int value: 'four' (see 'dsnd launch --help')",
        ),
        "--nprocs and --hostfile": (
            [*L, "2", "--hostfile", hf["ok"], D],
            "argument --hostfile: not allowed with argument --nprocs (see 'dsnd launch --help')",
        ),
        "unknown launcher": (
            ["launch", "--hostfile", hf["ok"], "--launcher", "srun", D],
            "argument --launcher: invalid choice: 'srun' (choose from dsnd, pdsh, openmpi, "
            "mpich, slurm) "
            "(see 'dsnd launch --help')",
        ),
        "unknown command": (
            ["lanch"],
            "argument command: invalid choice: 'lanch' (choose from env, ops, train, launch, "
            "bench, plan, ds-config, data, model, generate, plot, ckpt) (see 'dsnd --help')",
        ),
    }


BAD_NAMES = list(bad_inputs(Path("/unused")))


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input_is_one_line_and_exit_2(capsys, launches, tmp_path, name):
    for file, text in FILES.items():
        if file != "work/.deepspeed_env" or name == "bad .deepspeed_env":
            (tmp_path / file).write_text(text)
    argv, message = bad_inputs(tmp_path)[name]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    line = err.rstrip("\n")
    assert line.startswith("dsnd: error: ")
    assert "Traceback" not in err
    # argparse's wording of choices differs across Python versions ('x' vs x)
    assert line.replace("'", "") == f"dsnd: error: {message}".replace("'", ""), line
    assert launches == []  # refused before any rank starts


def test_train_refuses_bad_config_before_any_process_group(capsys, monkeypatch):
    import torch.distributed as dist

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(cli, "setup_logging", lambda rank: None)  # keep pytest's logging as is
    rc, out, err = run(capsys, "train", "--set", "parallel.pp=2", "--local_rank=0")
    assert rc == 2
    assert err == (
        "dsnd: error: world size 1 is not divisible by parallel.pp * parallel.tp = 2 * 1 = 2\n"
    )
    assert not dist.is_initialized()


# ---- dsnd's own launcher (agents) ----------------------------------------------------------------


def test_dsnd_launcher_plans_one_agent_per_host_over_ssh(capsys, tmp_path):
    hf = hostfile(tmp_path, "h1 slots=2\nh2 slots=2\n")
    rc, out, err = run(
        capsys,
        "launch",
        "--hostfile",
        hf,
        "--dry-run",
        "--json",
        "--master-port",
        "4321",
        "--set",
        "parallel.pp=2",
    )
    assert (rc, err) == (0, "")
    plan = json.loads(out)
    command = without_launch_tail(plan["command"])
    assert command[1:] == ["-u", "-m", "dsnd", "train", "--set", "parallel.pp=2"]
    assert [(a["host"], a["ranks"]) for a in plan["agents"]] == [("h1", [0, 1]), ("h2", [2, 3])]
    for agent in plan["agents"]:
        ssh = agent["command"]
        assert ssh[:4] == ["ssh", "-o", "BatchMode=yes", agent["host"]]
        assert ssh[4].startswith(f"cd {tmp_path / 'work'} && exec ")
        assert ssh[4].endswith("-u -m dsnd.launcher.agent")
    assert plan["ranks"] == expected_rows([("h1", 2), ("h2", 2)], pp=2, dp=2, tp=1)


def test_dsnd_launcher_passes_env_masks_secrets_and_checks_first(
    capsys, launches, tmp_path, monkeypatch
):
    (tmp_path / "work" / ".deepspeed_env").write_text('NCCL_DEBUG=INFO\nJSON={"a": "$b"}\n')
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    rc, out, err = run(
        capsys,
        "launch",
        "--nprocs",
        "2",
        "--set",
        "train.steps=3",
        "--set",
        'launch.env=["HF_TOKEN"]',
        "--master-port",
        "4321",
    )
    assert (rc, err) == (0, "")
    assert "hf_secret_value" not in out and "HF_TOKEN=****" in out
    assert 'JSON="{\\"a\\": \\"$b\\"}"' in out
    ((argvs, specs),) = launches
    assert argvs == [[sys.executable, "-u", "-m", "dsnd.launcher.agent"]]  # this machine: no ssh
    (spec,) = specs
    assert (spec.ranks, spec.world_size, spec.master_addr) == ([0, 1], 2, "127.0.0.1")
    assert spec.env["HF_TOKEN"] == "hf_secret_value" and spec.env["JSON"] == '{"a": "$b"}'
    assert spec.env["NCCL_DEBUG"] == "INFO" and spec.hang_timeout_s == 300.0
    # the preflight left nothing behind in the checkpoint directory it checked
    assert os.listdir(tmp_path / "work" / "runs" / "dsnd" / "checkpoints") == []

    monkeypatch.delenv("HF_TOKEN")
    rc, out, err = run(capsys, "launch", "--nprocs", "2", "--set", 'launch.env=["HF_TOKEN"]')
    assert (rc, out) == (2, "")
    assert err == "dsnd: error: launch.env: HF_TOKEN not set in the launching environment\n"
    assert len(launches) == 1  # nothing more started
