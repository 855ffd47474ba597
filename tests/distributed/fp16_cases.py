"""train_cases.py with fp16 allowed on this CPU: DeepSpeed's real fp16 path, run here.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fast fp16 kernels (not on these
machines), and then refuses `fp16.enabled`. torch computes in fp16 on any CPU all the same, so
this worker tells the accelerator it may: everything after that (fp16 modules, DeepSpeed's
dynamic loss scaler and its overflow skips, dsnd's scaling of each stage's backward, the
scaler in checkpoints) is the code a GPU runs.

Usage (every rank): python tests/distributed/fp16_cases.py OUT.json CASES.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from deepspeed.accelerator import get_accelerator  # noqa: E402

type(get_accelerator()).is_fp16_supported = lambda self: True

from tests.distributed.train_cases import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
