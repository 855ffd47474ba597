"""Run config and DeepSpeed JSON: strict loading, batch math, every rule; resolved once."""
