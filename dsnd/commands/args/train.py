"""``dsnd train``: the run config and the job this rank belongs to."""

from __future__ import annotations

import argparse

from dsnd.commands.args.common import add_config_args


def add_arguments(train: argparse.ArgumentParser) -> None:
    add_config_args(train)
    train.add_argument(
        "--job-id",
        help="the job this rank belongs to (set by dsnd launch; default: DSND_JOB_ID, "
        "TORCHELASTIC_RUN_ID or SLURM_JOB_ID): a restart resumes the job's own newest checkpoint",
    )
