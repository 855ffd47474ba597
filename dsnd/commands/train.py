"""``dsnd train``: join the world this process's launcher describes and train.

Every check runs before the process group starts (`prestart`). Rank 0 holds the locks of the
checkpoint root and log.dir for the whole run. After the start, how a rank ends is its exit code
(see `dsnd.errors`): a divergence is one line and code 3 on every rank; a rank whose collective
lost its peer says so in one line and exits 4, so that the launcher names the rank that failed
first; a save or a log.dir write the disk refused is one line and code 1 (4 on the ranks that
learnt of another's), the previous checkpoint kept; a second Ctrl-C is one line and code 130;
any other exception is printed as usual and exits 1. Every rank's traceback also goes to its
`log.dir/logs/rank_XXXXX.log`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import traceback
import uuid
from collections.abc import Callable

import torch.distributed as dist

from dsnd.checkpoint.resume import checkpoint_root
from dsnd.checkpoint.root import RootLock, run_dirs
from dsnd.checkpoint.verify import read_manifest
from dsnd.commands.prestart import check_before_start
from dsnd.config.elastic import resolve_world
from dsnd.config.load import load
from dsnd.distributed.discover import job_id as job_id_from_env
from dsnd.distributed.init import init_world, shutdown, world_info
from dsnd.distributed.launcher_watch import LauncherWatch
from dsnd.errors import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PEER_FAILED,
    EXIT_USAGE,
    Diverged,
    UserError,
    WriteFailed,
)
from dsnd.report.progress import rank_log_path, rank_prefix, use_console_prefix
from dsnd.stop_request import StopRequest

log = logging.getLogger(__name__)

# how torch.distributed reports a peer that died or stopped answering (gloo raises a plain
# RuntimeError: "Connection closed by peer ...", "Timed out waiting ... for recv ...")
_PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|[Tt]imed out|Socket Timeout|Broken pipe|"
    r"Connection refused|NCCL communicator was aborted"
)


def peer_failed(exc: BaseException) -> bool:
    """True when `exc` says another rank failed (its connection closed, or a collective timed
    out), rather than this rank."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc)))
    )


def run_train(
    config: str | None,
    sets: list[str],
    setup_logging: Callable[[int], None],
    job_id: str | None = None,
) -> int:
    # from here on SIGTERM / Ctrl-C, or the exit of the launcher that started this rank, mean
    # "save at the next step boundary and exit 0"
    with StopRequest(LauncherWatch.start(os.environ)) as stop:
        code = _run_train(config, sets, setup_logging, stop, job_id)
        # the run is over (trained and saved, or refused): a stop request arriving while the
        # process exits has nothing left to stop, and must not make its exit a signal's
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


def _run_train(
    config: str | None,
    sets: list[str],
    setup_logging: Callable[[int], None],
    stop: StopRequest,
    job_id: str | None,
) -> int:
    env = dict(os.environ)
    info = world_info(env)
    setup_logging(info.rank)
    res, elastic = resolve_world(load(config, sets), info.world_size)
    coord = res.topology.coord(info.rank)
    use_console_prefix(
        rank_prefix(info.rank, coord, res.topology.cp),
        logging.INFO if info.rank == 0 else logging.WARNING,
    )
    if elastic:
        log.info("%s", elastic)
    job_id = job_id or job_id_from_env(env)
    resume = check_before_start(res, job_id)  # a checksum failure of a given path ends here
    if resume is not None:
        step = read_manifest(resume)["step"]
        if step >= res.run.train.steps:
            if info.rank == 0:
                print(
                    f"dsnd: {resume} is at step {step}, train.steps={res.run.train.steps}: "
                    "nothing to train"
                )
            return 0
    named = job_id is not None
    with contextlib.ExitStack() as locks:
        if info.rank == 0:
            # no launcher named the job: rank 0 does, before it locks (the lock's holder says
            # which job it is) and for the manifests (shared once the world is up)
            job_id = job_id or uuid.uuid4().hex[:12]
            for path, what in run_dirs(checkpoint_root(res.run), res.run.log.dir):
                locks.enter_context(RootLock(path, what).acquire(job_id))
        return _train_in_world(res, info, resume, stop, job_id, share_id=not named)


def _train_in_world(res, info, resume, stop, job_id, share_id: bool) -> int:
    """Train; the exit code says how it ended (the trainer has put any traceback into the
    rank's log file)."""
    logfile = rank_log_path(res.run.log.dir, info.rank)
    from dsnd.distributed.groups import run_groups
    from dsnd.trainer import train

    try:
        init_world(info, res.run.dist.timeout_s, res.run.dist.backend, res.run.log.dir)
        if share_id:  # rank 0 named the job (`_run_train`): every rank takes its name
            ids = [job_id]
            dist.broadcast_object_list(ids, src=0)
            job_id = ids[0]
        train(res, run_groups(res), resume, stop, job_id)
        return 0
    except UserError as e:  # input found bad only after the start (a file changed meanwhile)
        print(f"dsnd: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Diverged as e:
        # every rank says it (any of them may be the first to exit, and its peers are then
        # killed); a dsnd agent passes identical error lines of its host's ranks on once
        print(f"dsnd: error: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except WriteFailed as e:  # a full disk: the previous checkpoint is kept (dsnd.errors)
        said = (
            f"rank {info.rank}: a peer failed first ({e})"
            if e.code == EXIT_PEER_FAILED
            else f"error: {e}"
        )
        print(f"dsnd: {said}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C: at once, but never inside a save
        print(
            "dsnd: interrupted (a second Ctrl-C); the last committed checkpoint stays latest",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    except Exception as e:
        if peer_failed(e):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(
                f"dsnd: rank {info.rank}: a peer failed first ({first[:200]}); traceback in "
                f"{logfile}",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_PEER_FAILED
        traceback.print_exc()
        print(
            f"dsnd: rank {info.rank} failed; traceback also in {logfile}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    finally:
        shutdown()


def run(args: argparse.Namespace) -> int:
    """``dsnd train``: ``args.setup_logging`` is the logging setup `dsnd.cli` hands over (it
    runs once this rank knows its number)."""
    return run_train(args.config, args.sets, args.setup_logging, args.job_id)
