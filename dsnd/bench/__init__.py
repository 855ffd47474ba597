"""Benchmarks (``dsnd bench``): measurements against targets, not pass/fail tests.

`results` is pure (formulas, medians, rows, formatting); `pipeline_rank` is the rank program
that measures; `ranks` starts rank processes on this machine.
"""
