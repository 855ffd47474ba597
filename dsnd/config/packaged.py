"""Where the configs dsnd ships lie: the default run YAML and its DeepSpeed JSONs (package data,
so an installed dsnd finds them from any directory)."""

from __future__ import annotations

import os
from importlib import resources


def default_config_path() -> str:
    """The packaged default YAML (installed as package data)."""
    return str(resources.files("dsnd") / "configs" / "default.yaml")


def packaged_json(stage: int) -> str:
    """The packaged DeepSpeed JSON for ZeRO stage `stage`, ``zero<stage>.json``."""
    return os.path.join(os.path.dirname(default_config_path()), f"zero{stage}.json")
