"""Stage boundaries from layer weights, cut exactly as DeepSpeed's `PipelineModule` cuts them.

DeepSpeed's `partition_uniform` and `partition_balanced` (`deepspeed.runtime.utils`) written out
in plain Python, so the Plan needs no DeepSpeed to import; same arithmetic (float64 sums, the
same tie-breaking: the last split of equal cost wins), so a dsnd stage holds the layers
DeepSpeed's stage of that rank would, and tests/unit/test_partition.py compares the two on
many inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`num_parts` + 1 boundaries of counts as even as possible, the remainder to the first."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, residual = divmod(num_items, num_parts)
    return [p * size + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries minimising (heaviest part - lightest part), the linear partition problem by
    dynamic programming over (first i items, j parts), as DeepSpeed solves it."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if dp_cost[i][j] >= high - low:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = high - low, high, low
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]
