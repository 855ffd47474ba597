"""Benchmarks (``dsnd bench``): measurements against targets, not pass/fail tests.

`results` and the other ``*_results`` are pure (formulas, medians, rows, formatting); each
``*_rank`` is a rank program that measures (``dsnd bench`` starts it on gloo ranks of this
machine), and `rank` is what they all do around their measurement.
"""
