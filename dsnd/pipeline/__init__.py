"""Pipeline parallelism at run time: this rank's stage, links, executor of its program.

Pipeline parallelism at run time: this rank's stage (its layers, engine and tied weights),
the links to the other stages, and the executor that runs the plan's program for it.

What to run — partition and schedules, pure data — lives in `dsnd.plan`. Submodules are
imported by name (``dsnd.pipeline.executor``); this package imports nothing itself.
"""
