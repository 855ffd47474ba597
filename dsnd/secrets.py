"""Secrets are names: a variable or config key whose name contains KEY, TOKEN, SECRET or PASSWORD
(any case) holds a secret. Its value is shown as MASK in logs and never written into a
checkpoint, a saved config or TensorBoard.

Matching is by substring, as the names are written by people (`HF_TOKEN`, `WANDB_API_KEY`,
`comet.api_key`): masking a harmless `KEYBOARD` costs nothing, missing a secret costs a leak.
"""

from __future__ import annotations

from typing import Any

MASK = "****"
_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in _MARKERS)


def mask_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with every secret's value replaced by MASK."""
    return {k: MASK if is_secret(k) else v for k, v in env.items()}


def mask_config(value: Any) -> Any:
    """A copy of nested dicts/lists in which every string or number under a secret key is MASK.

    Only leaf values are masked, so a section whose name happens to match (none does in dsnd's
    schema) keeps its structure.
    """
    if isinstance(value, dict):
        return {
            k: MASK
            if is_secret(str(k)) and not isinstance(v, (dict, list)) and v is not None
            else mask_config(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [mask_config(v) for v in value]
    return value
