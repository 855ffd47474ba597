"""The one-line error a run config's layout gets from `resolve`, for the refusal tests."""

from __future__ import annotations

import pytest

from dsnd.config.load import load
from dsnd.config.resolve import resolve
from dsnd.errors import UserError


def resolve_error(sets: list[str], world: int) -> str:
    """The UserError that resolving the packaged config with `sets` on `world` ranks raises
    (checked to be one line)."""
    with pytest.raises(UserError) as e:
        resolve(load(None, sets), world)
    assert "\n" not in str(e.value)
    return str(e.value)
