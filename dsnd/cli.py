"""``dsnd``: train | launch | plan | bench | env | ops | ckpt | plot | data | model | generate |
ds-config.

User-input errors (`UserError`) end as one line ``dsnd: error: ...`` on stderr and exit code 2,
before any process group starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from dsnd import __version__
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


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run YAML (default: the packaged llama-tiny config)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run key, or a DeepSpeed key as ds.KEY=VALUE (repeatable)",
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

    sub.add_parser("env", help="versions, accelerator and backend")

    ops = sub.add_parser("ops", help="DeepSpeed's compiled ops")
    ops_what = ops.add_subparsers(dest="ops_command", required=True)
    build = ops_what.add_parser("build", help="compile the ops dsnd uses now, not at first launch")
    build.add_argument("names", nargs="*", metavar="BUILDER",
                       help="DeepSpeed builder class names (default: all dsnd uses)")  # fmt: skip

    train = sub.add_parser("train", help="train in the world this process's launcher describes")
    _add_config_args(train)
    train.add_argument(
        "--job-id",
        help="the job this rank belongs to (set by dsnd launch; default: DSND_JOB_ID, "
        "TORCHELASTIC_RUN_ID or SLURM_JOB_ID): a restart resumes the job's own newest checkpoint",
    )

    launch = sub.add_parser("launch", help="check the config, then start every rank")
    _add_config_args(launch)
    where = launch.add_mutually_exclusive_group()
    where.add_argument("--nprocs", type=int, help="ranks on this machine (deepspeed --num_gpus)")
    where.add_argument("--hostfile", help="DeepSpeed hostfile: 'HOST slots=N' per line")
    launch.add_argument(
        "--launcher",
        choices=("dsnd", "pdsh", "openmpi", "mpich", "slurm"),
        default="dsnd",
        help="dsnd (default): a dsnd agent per host (ssh) supervises its ranks; pdsh: deepspeed "
        "--hostfile; openmpi, mpich: mpirun; slurm: srun (hosts: --hostfile's Slurm node names, "
        "else the allocation's)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="relaunch a failed job up to N times from its last committed checkpoint",
    )
    launch.add_argument("--include", help="DeepSpeed resource filter, e.g. host1@host2:0,1")
    launch.add_argument("--exclude", help="DeepSpeed resource filter")
    launch.add_argument("--master-addr", help="rendezvous address (default: the first host)")
    launch.add_argument(
        "--master-port",
        type=int,
        help="rendezvous port (default: a free port for --nprocs, 29500 with --hostfile)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    launch.add_argument("--json", action="store_true", help="with --dry-run: machine-readable")

    bench = sub.add_parser("bench", help="measure dsnd against DeepSpeed (a benchmark, not a test)")
    from dsnd.commands.bench import BENCHES

    bench.add_argument(
        "name",
        choices=tuple(BENCHES),
        help="; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items()),
    )
    bench.add_argument("--steps", type=int, help="timed repetitions per side (default: 40; "
                       "context: 3)")  # fmt: skip
    bench.add_argument("--warmup", type=int, help="untimed repetitions first (default: 10; "
                       "context: 1)")  # fmt: skip
    bench.add_argument("--micro-batches", type=int, default=8, help="gradient accumulation steps")
    bench.add_argument("--json", action="store_true", help="one JSON object per metric line")
    bench.add_argument("--seqs", default="2048,4096,8192",
                       help="context: the sequence lengths, comma-separated")  # fmt: skip
    bench.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run key of every run the bench resolves, e.g. model.hidden_size=512 "
        "(repeatable)",
    )

    plan = sub.add_parser("plan", help="choose a parallel layout before launch: every layout "
                          "predicted (memory per device, step time) and ranked")  # fmt: skip
    from dsnd.commands.plan import add_arguments as plan_arguments

    plan_arguments(plan)

    ds_config = sub.add_parser("ds-config", help="what dsnd does with a DeepSpeed JSON")
    ds_what = ds_config.add_subparsers(dest="ds_command", required=True)
    for name, text in (
        ("check", "each key: used, filled in, no effect or ignored; every problem at once"),
        ("explain", "check, then batch math, precision, ZeRO, offload, memory"),
    ):
        what = ds_what.add_parser(name, help=text)
        what.add_argument("file", metavar="FILE", help="a DeepSpeed JSON")
        what.add_argument("--config", help="the run YAML (default: dsnd's default run)")
        what.add_argument("--nprocs", type=int, default=1, help="ranks the run has")
        what.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                          help="a run key or ds.KEY (repeatable)")  # fmt: skip

    data = sub.add_parser("data", help="prepare a pre-tokenized corpus")
    data_what = data.add_subparsers(dest="data_command", required=True)
    prepare = data_what.add_parser("prepare", help="tokenize a text/JSONL file into OUT.bin")
    prepare.add_argument("source", metavar="INPUT", help="a text or JSONL file")
    prepare.add_argument("out", metavar="OUT", help="the token file to write (e.g. train.bin)")
    prepare.add_argument("--format", default="auto", choices=("auto", "text", "jsonl"))
    prepare.add_argument("--text-field", default="text", help="JSONL field with the text")
    prepare.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default) or a local transformers tokenizer directory",
    )

    model = sub.add_parser("model", help="the shipped presets; a model's size and layers")
    model_what = model.add_subparsers(dest="model_command", required=True)
    model_what.add_parser("list", help="every shipped preset with its parameter count")
    show = model_what.add_parser("show", help="parameters (exact) and the per-layer table")
    show.add_argument("name", metavar="NAME|DIR", help="a preset, model directory or config.json")

    gen = sub.add_parser("generate", help="sample text from a checkpoint of any layout")
    gen.add_argument("checkpoint", metavar="CKPT", help="a checkpoint root or step directory")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--tokens", type=int, default=64, help="how many tokens to add")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")

    plot = sub.add_parser("plot", help="loss and throughput curves of runs side by side (PNG)")
    plot.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="a run's log.dir")
    plot.add_argument("-o", "--out", required=True, help="the PNG to write")

    ckpt = sub.add_parser("ckpt", help="inspect, verify or export a saved dsnd checkpoint; "
                          "import one DeepSpeed saved")  # fmt: skip
    what = ckpt.add_subparsers(dest="ckpt_command", required=True)
    where_help = "a checkpoint root (its 'latest') or a step directory"
    inspect = what.add_parser("inspect", help="manifest summary and every file's checksum")
    inspect.add_argument("dir", help=where_help)
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    verify = what.add_parser(
        "verify",
        help="check every file's size and SHA-256, the manifest, the tensor headers and that "
        "every value is finite",
    )
    verify.add_argument("dir", help=where_help)
    export = what.add_parser("export", help="write the weights as a transformers directory")
    export.add_argument("dir", help=where_help)
    export.add_argument("out", help="new (or empty) output directory")
    imp = what.add_parser(
        "import",
        help="convert a checkpoint DeepSpeed's engine saved (ZeRO 1-3, pipeline or not) into a "
        "dsnd checkpoint of the run config's model",
    )
    imp.add_argument(
        "dir",
        metavar="DS_CHECKPOINT_DIR",
        help="the directory save_checkpoint wrote (its 'latest' tag) or one tag",
    )
    imp.add_argument("out", metavar="OUT", help="new (or empty) dsnd checkpoint root")
    _add_config_args(imp)
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(strip_local_rank(sys.argv[1:] if argv is None else argv))
        pin_accelerator()
        use_environment_dir()  # before DeepSpeed is imported: its ops build per environment
        if args.command == "env":
            from dsnd.commands.env import run_env

            return run_env()
        if args.command == "ops":
            from dsnd.commands.ops import run_build

            return run_build(args.names)
        if args.command == "train":
            from dsnd.commands.train import run_train

            return run_train(args.config, args.sets, setup_logging, args.job_id)
        if args.command == "plan":
            from dsnd.commands.plan import run_plan

            return run_plan(args)
        if args.command == "bench":
            from dsnd.commands.bench import run_bench

            return run_bench(args)
        if args.command == "ds-config":
            from dsnd.commands.ds_config import run_check, run_explain

            return (run_check if args.ds_command == "check" else run_explain)(args)
        if args.command == "data":
            from dsnd.commands.data import run_prepare

            return run_prepare(args.source, args.out, args.format, args.text_field,
                               args.tokenizer)  # fmt: skip
        if args.command == "model":
            from dsnd.commands.model import run_list, run_show

            return run_list() if args.model_command == "list" else run_show(args.name)
        if args.command == "generate":
            from dsnd.commands.generate import run_generate

            return run_generate(args.checkpoint, args.prompt, args.tokens, args.temperature,
                                args.seed)  # fmt: skip
        if args.command == "plot":
            from dsnd.commands.plot import run_plot

            return run_plot(args.log_dirs, args.out)
        if args.command == "ckpt":
            from dsnd.commands.ckpt import run_ckpt

            return run_ckpt(args)
        from dsnd.commands.launch import run_launch

        return run_launch(args)
    except UserError as e:
        for line in str(e).splitlines():
            print(f"dsnd: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
