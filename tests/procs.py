"""Real processes for tests: rank programs (gloo over loopback) and the `dsnd` CLI.

Each rank is its own Python process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, exactly as DeepSpeed's launcher or torchrun would set them (the environment of
`dsnd.launcher.local_ranks`, the code `dsnd bench` uses). The ranks are forked from a process that
has imported torch, DeepSpeed, transformers and dsnd once (`tests.zygote`: about 7 CPU-seconds
saved per rank); ``DSND_TEST_FRESH_RANKS=1`` starts each in a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from dsnd.launcher.local_ranks import base_env, checked_outputs, free_port
from dsnd.launcher.local_ranks import rank_env as _rank_env
from dsnd.launcher.local_ranks import run_ranks as _run_ranks
from tests import zygote
from tests.nccl_rules import record, replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
__all__ = ["ROOT", "free_port", "rank_env", "run_cli", "run_ranks"]


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One thread per process, CPU accelerator, this checkout first on the path."""
    return base_env(extra)


def run_ranks(world: int, argv: list[str], timeout: float = 300) -> list[str]:
    """Run `python <argv>` from the checkout as `world` ranks; each rank's output. Every
    communication call the ranks make is recorded and replayed under NCCL's rules, in both of
    torch's modes (`tests.nccl_rules`): a run that would hang or mismatch on NCCL fails here,
    though gloo ran it."""
    with tempfile.TemporaryDirectory(prefix="nccl-trace-") as folder:
        previous = os.environ.get(record.ENV)
        os.environ[record.ENV] = folder  # the ranks inherit this environment
        try:
            if os.environ.get("DSND_TEST_FRESH_RANKS") == "1":
                outputs = _run_ranks(world, argv, timeout, cwd=ROOT)
            else:
                outputs = _forked_ranks(world, argv, timeout)
        finally:
            if previous is None:
                del os.environ[record.ENV]
            else:
                os.environ[record.ENV] = previous
        records = replay.load(folder)
        if len(records) != world:  # a rank that recorded nothing would pass unseen
            raise AssertionError(
                f"{' '.join(argv)}: {len(records)} of {world} ranks left an "
                f"NCCL-rules record (tests/distributed/worker.world writes it)"
            )
        assert_nccl_rules(records, " ".join(argv))
    return outputs


def _forked_ranks(world: int, argv: list[str], timeout: float) -> list[str]:
    """`world` ranks of `python <argv>` forked from the session's zygote (`tests.zygote`), each
    with the environment `dsnd.launcher.local_ranks` gives a rank; their outputs, or
    RanksFailed with every rank's output, as `local_ranks.run_ranks` raises it."""
    port = free_port()
    # torch's libuv TCPStore server does not serve in a process forked after torch's import
    # (its clients time out connecting); the classic server does
    envs = [{**_rank_env(rank, world, port), "USE_LIBUV": "0"} for rank in range(world)]
    return checked_outputs(*zygote.run(world, argv, timeout, envs, ROOT))


def assert_nccl_rules(records: list[dict], what: str) -> None:
    """Fail with the first problems of replaying `records` under NCCL's rules, in either mode."""
    for mode in replay.MODES:
        problems = replay.replay(records, mode)
        if problems:
            shown = "\n  ".join(problems[:12])
            more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
            raise AssertionError(
                f"{what}: would not run on NCCL ({mode} mode), "
                f"{len(problems)} problems:\n  {shown}{more}"
            )


def python_json(code: str, *args: str, timeout: float = 400):
    """`python -c <code> <args>` run from the checkout in a rank's environment; the JSON value
    its last line of output prints (a reference run's rows, say)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(
    args: list[str], timeout: float = 600, cwd: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m dsnd <args>` as a real subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "dsnd", *args],
        cwd=cwd or ROOT,
        env=rank_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_log_text(log_dir: str, rank: int, marker: str) -> str:
    """What follows `marker` on the last line of rank `rank`'s log (under `log_dir`/logs) that
    holds it."""
    with open(os.path.join(log_dir, "logs", f"rank_{rank:05d}.log")) as f:
        lines = [line for line in f if marker in line]
    return lines[-1].split(marker, 1)[1].strip()


def metrics_rows(log_dir) -> list[dict]:
    """The rows of `log_dir`/metrics.jsonl written so far: none before the first, and not a line
    rank 0 is still writing."""
    try:
        with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1]]


def assert_same_steps(got: list[dict], want: list[dict]) -> None:
    """The same steps, each with a bit-identical loss, gradient norm and learning rate."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
