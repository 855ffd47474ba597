"""``dsnd``: train | launch | plan | bench | env | ops | ckpt | plot | data | model | generate |
ds-config.

User-input errors (`UserError`) end as one line ``dsnd: error: ...`` on stderr and exit code 2,
before any process group starts.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections import namedtuple

from dsnd import __version__
from dsnd.commands.args import (
    bench,
    ckpt,
    data,
    ds_config,
    generate,
    launch,
    model,
    ops,
    plan,
    plot,
    train,
)
from dsnd.errors import UserError
from dsnd.extensions import use_environment_dir

log = logging.getLogger("dsnd")


def strip_local_rank(argv: list[str]) -> list[str]:
    """Drop ``--local_rank=N`` / ``--local_rank N`` that DeepSpeed's launcher appends (dsnd reads
    LOCAL_RANK from the environment instead)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif re.fullmatch(r"--local[_-]rank=\d+", arg):
            pass
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        else:
            out.append(arg)
    return out


class Command(namedtuple("Command", "name help arguments runner")):
    """One ``dsnd NAME``: its help line, its arguments' module (``add_arguments(parser)``, None
    for none) and its runner, ``module:function`` taking the parsed args: imported only when the
    command runs, after `pin_accelerator` and `use_environment_dir`, since most import DeepSpeed.
    (A plain namedtuple: `typing` would add to every ``dsnd --help``.)"""

    __slots__ = ()


COMMANDS = (
    Command("env", "versions, accelerator and backend", None, "dsnd.commands.env:run"),
    Command("ops", "DeepSpeed's compiled ops", ops, "dsnd.commands.ops:run"),
    Command(
        "train",
        "train in the world this process's launcher describes",
        train,
        "dsnd.commands.train:run",
    ),
    Command(
        "launch",
        "check the config, then start every rank",
        launch,
        "dsnd.commands.launch:run_launch",
    ),
    Command(
        "bench",
        "measure dsnd against DeepSpeed (a benchmark, not a test)",
        bench,
        "dsnd.commands.bench:run_bench",
    ),
    Command(
        "plan",
        "choose a parallel layout before launch: every layout predicted (memory per "
        "device, step time) and ranked",
        plan,
        "dsnd.commands.plan:run_plan",
    ),
    Command(
        "ds-config",
        "what dsnd does with a DeepSpeed JSON",
        ds_config,
        "dsnd.commands.ds_config:run",
    ),
    Command("data", "prepare a pre-tokenized corpus", data, "dsnd.commands.data:run"),
    Command(
        "model", "the shipped presets; a model's size and layers", model, "dsnd.commands.model:run"
    ),
    Command(
        "generate",
        "sample text from a checkpoint of any layout",
        generate,
        "dsnd.commands.generate:run",
    ),
    Command(
        "plot",
        "loss and throughput curves of runs side by side (PNG)",
        plot,
        "dsnd.commands.plot:run",
    ),
    Command(
        "ckpt",
        "inspect, verify or export a saved dsnd checkpoint; import one DeepSpeed saved",
        ckpt,
        "dsnd.commands.ckpt:run_ckpt",
    ),
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a UserError (one line, exit 2) like every other input
    error, instead of the usage block followed by ``dsnd launch: error: ...``."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsnd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dsnd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        if command.arguments is not None:
            command.arguments.add_arguments(p)
    return parser


def setup_logging(rank: int) -> None:
    """Rank 0 talks (INFO); other ranks only warn. DeepSpeed's INFO chatter is silenced."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"[r{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def pin_accelerator() -> None:
    """Name DeepSpeed's accelerator explicitly: its auto-detection prints a warning on every
    CPU-only import, which would break the one-line error contract."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


def _run(args: argparse.Namespace) -> int:
    """The command's runner, imported now (see `Command`)."""
    runner = next(c.runner for c in COMMANDS if c.name == args.command)
    module, function = runner.split(":")
    return getattr(importlib.import_module(module), function)(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(strip_local_rank(sys.argv[1:] if argv is None else argv))
        pin_accelerator()
        use_environment_dir()  # before DeepSpeed is imported: its ops build per environment
        args.setup_logging = setup_logging  # train's, read here so that a test may replace it
        return _run(args)
    except UserError as e:
        for line in str(e).splitlines():
            print(f"dsnd: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
