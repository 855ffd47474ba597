"""`dsnd launch --min-hosts K`: a job that goes on when a host is lost, and grows back.

Before every start, each host of the hostfile is asked the preflight questions
(`launch_preflight`); the hosts that answer, and only they, run this attempt (at least K of them,
else the job ends). The layout is chosen for their ranks by the elastic rule
(`dsnd.config.elastic`: the same global batch, the run's degrees kept where they divide), and the
ranks resume the job's newest checkpoint on it. So a host lost mid-run (its agent gone, ssh
unreachable) fails the attempt; the restart leaves it out; a host that answers again is taken
back at the next start. With `--rejoin` a missing host is asked every REJOIN_PROBE_S while the
job runs; once it answers the ranks save at the next step and the job starts again on the
larger world (not counted against --max-restarts).

Every start says what it runs and why (the launcher's output; the ranks' metrics.jsonl
`run_start` and TensorBoard text through LAYOUT_WHY_ENV).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from dsnd.commands.launch_argv import agent_launches
from dsnd.commands.launch_preflight import host_problems
from dsnd.config.elastic import batch_fixed, resolve_world
from dsnd.config.load import load
from dsnd.config.resolve import Resolved, resolve
from dsnd.errors import UserError
from dsnd.launcher.protocol import failed_on_their_own
from dsnd.launcher.supervisor import JobResult, supervise
from dsnd.report.reporter import LAYOUT_WHY_ENV

REJOIN_PROBE_S = 2.0
PROBE_TIMEOUT_S = 20.0  # a host that does not answer the preflight within this is left out


def pinned_sets(config: str | None, sets: list[str], world: int) -> list[str]:
    """`sets` plus elastic.enabled and, where the DeepSpeed JSON leaves them to the world, the
    global batch and micro-batch of the whole hostfile's layout, pinned for every start."""
    loaded = load(config, sets)
    out = [*sets, "elastic.enabled=true"]
    if not batch_fixed(loaded.ds):
        batch = resolve(loaded, world).batch
        out += [
            f"ds.train_batch_size={batch.train}",
            f"ds.train_micro_batch_size_per_gpu={batch.micro}",
        ]
    return out


def live_hosts(
    args: argparse.Namespace,
    slots: dict[str, list[int]],
    res: Resolved,
    env: dict[str, str],
    port: bool = True,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(the hosts that answer the preflight with no problem, in hostfile order; {host: why it is
    left out}); the first is asked for the rendezvous port unless not `port` (hosts asked to
    rejoin a running job). A problem of this machine's own (the checkpoint directory, another
    run's lock on it) is a UserError, unless not `port`."""
    launches = agent_launches(args, slots, res, env, args.sets)
    per_host, own = host_problems(args, launches, slots, res, PROBE_TIMEOUT_S, port)
    if own and port:  # (not asked for a running job's hosts: its own lock holds the directory)
        raise UserError(f"preflight: {own[0]}")
    live = {h: s for h, s in slots.items() if not per_host.get(h)}
    gone = {h: "; ".join(lines) for h, lines in per_host.items() if lines}
    return live, gone


def _watch_missing(
    args: argparse.Namespace,
    missing: dict[str, list[int]],
    res: Resolved,
    env: dict[str, str],
    found: threading.Event,
    done: threading.Event,
) -> None:
    """Thread: ask the missing hosts every REJOIN_PROBE_S until one answers (`found`) or the
    attempt ends (`done`)."""
    while not done.wait(REJOIN_PROBE_S):
        try:
            live, _ = live_hosts(args, missing, res, env, port=False)
        except UserError:
            continue
        if live:
            print(
                f"dsnd: elastic: {', '.join(live)} answers again: saving at the next step "
                "to start again with it (--rejoin)",
                file=sys.stderr,
                flush=True,
            )
            found.set()
            return


def _metrics_rows(res: Resolved) -> int:
    """Rows in the run's metrics.jsonl as this machine sees it (-1: it cannot read it)."""
    try:
        with open(os.path.join(res.run.log.dir, "metrics.jsonl"), "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0
    except OSError:
        return -1


def suspects(result: JobResult, progressed: bool) -> dict[str, str]:
    """{host: why} of the hosts a failed attempt blames, left out of the next start: those whose
    agent ended without a report, and, when the attempt trained no step, the host of the first
    rank that failed on its own (not killed by its agent, not a peer's consequence)."""
    out = {h: "its agent ended without a report in the last attempt" for h in result.lost_hosts}
    own = failed_on_their_own(result.outcomes)
    if not progressed and own:
        host = min(own, key=lambda o: o.ended_at).host
        out.setdefault(host, "its ranks failed before the last attempt trained a step")
    return out


def _attempt(
    args: argparse.Namespace,
    slots: dict[str, list[int]],
    first: Resolved,
    env: dict[str, str],
    why: str,
    blamed: dict[str, str],
) -> tuple[JobResult | None, int]:
    """One start on the hosts that answer: (its result, or None when it could not start, with
    the exit code to end with). `first` is the run resolved for the whole hostfile (its
    checkpoint directory and timeouts serve the preflight); the `blamed` hosts are left out
    unless that would leave fewer than --min-hosts."""
    live, gone = live_hosts(args, slots, first, env)
    if len([h for h in live if h not in blamed]) >= args.min_hosts:
        gone.update({h: blamed[h] for h in live if h in blamed})
        live = {h: s for h, s in live.items() if h not in blamed}
    for host, reason in gone.items():
        print(f"dsnd: elastic: leaving out host {host}: {reason}", file=sys.stderr, flush=True)
    if len(live) < args.min_hosts:
        print(
            f"dsnd: error: elastic: {len(live)} of {len(slots)} hosts answer, fewer than "
            f"--min-hosts {args.min_hosts}",
            file=sys.stderr,
            flush=True,
        )
        return None, 1
    world = sum(len(s) for s in live.values())
    res, line = resolve_world(load(args.config, args.sets), world)
    why = why + (f"; hosts left out: {', '.join(gone)}" if gone else "")
    print(f"dsnd: {line} ({why})", flush=True)
    found, done = threading.Event(), threading.Event()
    missing = {h: s for h, s in slots.items() if h not in live}
    if args.rejoin and missing:
        threading.Thread(
            target=_watch_missing, args=(args, missing, res, env, found, done), daemon=True
        ).start()
    try:
        result = supervise(
            agent_launches(args, live, res, {**env, LAYOUT_WHY_ENV: why}, args.sets), regrow=found
        )
    finally:
        done.set()
    return result, 0


def run_elastic(
    args: argparse.Namespace, slots: dict[str, list[int]], first: Resolved, env: dict[str, str]
) -> int:
    """Attempts until one ends the job: succeeds, stops on request, diverges, cannot start, or
    fails after --max-restarts restarts. A restart for --rejoin is not counted."""
    why, failures, blamed = "the first start", 0, {}
    while True:
        rows = _metrics_rows(first)
        try:
            result, code = _attempt(args, slots, first, env, why, blamed)
        except UserError as e:
            print(f"dsnd: error: {e}", file=sys.stderr, flush=True)
            return 2
        if result is None:
            return code
        if result.regrow:
            why, blamed = "a missing host answers again (--rejoin)", {}
            continue
        if result.failure is None:
            return 0
        if result.stop_signal is not None or result.diverged or failures == args.max_restarts:
            print(f"dsnd: job failed: {result.failure}", file=sys.stderr, flush=True)
            return 1
        failures += 1
        blamed = suspects(result, progressed=rows < 0 or _metrics_rows(first) > rows)
        why = f"restart {failures} of {args.max_restarts} after: {result.failure}"
        print(
            f"dsnd: elastic: {why}; choosing the hosts and layout again",
            file=sys.stderr,
            flush=True,
        )
