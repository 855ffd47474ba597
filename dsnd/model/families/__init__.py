"""The supported model families, one module each; `FAMILIES` is the only list of them."""

from __future__ import annotations

from dsnd.model.families import gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from dsnd.model.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    gpt2.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
)


def by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"unknown model family {name!r}; dsnd has {', '.join(supported())}")


def supported() -> list[str]:
    """Every architecture name dsnd trains (as config.json's `architectures` spells them)."""
    return [arch for family in FAMILIES for arch in family.architectures]


def family_of(raw: dict) -> Family | None:
    """The family a config.json's `architectures` (else its `model_type`) names, or None."""
    archs = raw.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in archs):
            return family
    if not archs:
        for family in FAMILIES:
            if raw.get("model_type") in family.model_types:
                return family
    return None
