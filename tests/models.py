"""Model specs for tests: a shipped preset, optionally reshaped, as a run config would make it."""

from __future__ import annotations

from typing import Any

from dsnd.model.spec import ModelSpec, load_model


def spec_of(name: str, overrides: dict[str, Any] | None = None, **shape: int) -> ModelSpec:
    """`name` with shape overrides (model.hidden_size=... spelled hidden_size=...) and
    config.json `overrides`, as `model.preset` / `model.overrides` would give it."""
    return load_model(name, "model.preset", shape, overrides)
