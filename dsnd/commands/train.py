"""``dsnd train``: join the world this process's launcher describes and train."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from dsnd.checkpoint.layout import read_manifest
from dsnd.checkpoint.resume import choose_resume
from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.dist.init import init_world, shutdown, world_info
from dsnd.pipeline.stage import check_stages
from dsnd.progress import rank_prefix, use_console_prefix
from dsnd.stop_request import StopRequest


def run_train(config: str | None, sets: list[str], setup_logging: Callable[[int], None]) -> int:
    # from here on SIGTERM / Ctrl-C mean "save at the next step boundary and exit 0"
    with StopRequest() as stop:
        return _run_train(config, sets, setup_logging, stop)


def _run_train(
    config: str | None, sets: list[str], setup_logging: Callable[[int], None], stop: StopRequest
) -> int:
    info = world_info(dict(os.environ))
    setup_logging(info.rank)
    # every check runs before the process group starts
    res = resolve(load(config, sets), info.world_size)
    use_console_prefix(rank_prefix(info.rank, res.topology.coord(info.rank)),
                       logging.INFO if info.rank == 0 else logging.WARNING)  # fmt: skip
    check_stages(res)
    data = res.run.data
    if data.path and (
        data.format == "tokens" or (data.format == "auto" and data.path.lower().endswith(".bin"))
    ):
        from dsnd.data.token_file import check_vocab, read_token_file

        check_vocab(read_token_file(data.path, 0)[1]["vocab_size"], res.dims.vocab_size, data.path)
    resume = choose_resume(res.run)  # a checksum failure of a given path ends here (exit 2)
    if resume is not None:
        step = read_manifest(resume)["step"]
        if step >= res.run.train.steps:
            if info.rank == 0:
                print(f"dsnd: {resume} is at step {step}, train.steps={res.run.train.steps}: "
                      "nothing to train")  # fmt: skip
            return 0
    elif res.run.model.init_from:
        from dsnd.model.hf_io import check_hf_config

        check_hf_config(res.run.model.init_from, res.dims)

    from dsnd.dist.groups import build_groups
    from dsnd.trainer import train

    init_world(info, res.run.dist.timeout_s, res.run.dist.backend)
    try:
        train(res, build_groups(res.topology), resume, stop)
    finally:
        shutdown()
    return 0
