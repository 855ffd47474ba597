"""dsnd: train large language models on DeepSpeed with pipeline x ZeRO x tensor parallelism."""

__version__ = "0.1.0"
