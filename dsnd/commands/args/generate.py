"""``dsnd generate CKPT --prompt TEXT``."""

from __future__ import annotations

import argparse


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("checkpoint", metavar="CKPT", help="a checkpoint root or step directory")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--tokens", type=int, default=64, help="how many tokens to add")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
