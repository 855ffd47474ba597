"""Which variables a dsnd launch passes to every rank on every host, as a pure function.

A remote rank starts from its host's login environment; on top of it comes what this returns:
variables whose names start like DeepSpeed's runner exports them (PYTHON..., NCCL..., MLFLOW...,
MV2..., UCX...) plus dsnd's own DSND_..., the names in `launch.env`, and `.deepspeed_env`'s
lines (which win). The values travel inside the agent's JSON spec over stdin, never through a
shell, so quotes, `$`, JSON and newlines arrive byte for byte.
"""

from __future__ import annotations

import json

from dsnd.config.resolve import RANK_VARIABLES
from dsnd.errors import UserError
from dsnd.secrets import MASK, is_secret

FORWARDED_PREFIXES = ("PYTHON", "NCCL", "MLFLOW", "MV2", "UCX", "DSND_")


def passed_env(
    environ: dict[str, str], names: list[str], env_file: dict[str, str]
) -> dict[str, str]:
    """The variables for every rank; a name in `launch.env` missing from `environ` is an error."""
    missing = [n for n in names if n not in environ]
    if missing:
        raise UserError(f"launch.env: {', '.join(missing)} not set in the launching environment")
    out = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    out.update({n: environ[n] for n in names})
    out.update(env_file)
    return {k: v for k, v in sorted(out.items()) if k not in RANK_VARIABLES}


def describe(env: dict[str, str]) -> str:
    """One log line: every passed variable, secrets masked, values JSON-quoted."""
    items = " ".join(f"{k}={MASK if is_secret(k) else json.dumps(v)}" for k, v in env.items())
    return f"passing {len(env)} variables to every rank: {items}"
