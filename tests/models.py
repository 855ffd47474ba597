"""Model specs for tests: a shipped preset, optionally reshaped, as a run config would make it."""

from __future__ import annotations

from typing import Any

from dsnd.model.source import ModelSpec, load_model


def spec_of(name: str, overrides: dict[str, Any] | None = None, **shape: int) -> ModelSpec:
    """`name` with shape overrides (model.hidden_size=... spelled hidden_size=...) and
    config.json `overrides`, as `model.preset` / `model.overrides` would give it."""
    return load_model(name, "model.preset", shape, overrides)


def random_hf_model(spec: ModelSpec, seed: int = 3) -> Any:
    """`transformers`' model of `spec` in fp32 with seeded random weights, every parameter then
    nudged (norm gains and biases away from 1 and 0, so a misplaced one shows in the logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()
