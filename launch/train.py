"""Train with dsnd from any launcher that runs a script per rank.

    deepspeed --hostfile hostfiles/localhost launch/train.py --config RUN.yaml --set KEY=VALUE
    deepspeed --num_gpus 4 launch/train.py        # one machine without ssh (a hostfile needs it)
    torchrun --nproc-per-node 2 launch/train.py

The same as `dsnd train ...` (DeepSpeed's `--local_rank=N` argument is accepted and ignored:
dsnd reads LOCAL_RANK from the environment).
"""

import sys

from dsnd.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
