"""Pipeline parallelism: stage partitioning, schedules (pure data), p2p and the executor.

Submodules are imported by name (``dsnd.pipeline.schedule``); this package imports nothing so
that the pure parts stay free of torch.distributed.
"""
