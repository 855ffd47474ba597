"""The phases a pipeline step's time is split into, one name each, disjoint.

- forward / backward: the layers' compute;
- comm: tied weights, the tensor group's sums, the data-parallel reduction, waiting for sends;
- optimizer: the engine's step;
- pipeline_wait: blocked in receives (the pipeline bubble as a stage sees it).

The executor measures them per step; telemetry gathers and reports them. A module of its own,
so reporting does not depend on the executor.
"""

PHASES = ("forward", "backward", "comm", "optimizer", "pipeline_wait")
