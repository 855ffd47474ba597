"""Mixture of experts as one component: ep experts, capacity, load, aux loss, numbers.

Mixture of experts as one component: expert-parallel experts (a layer's experts split over an
expert-parallel group carved out of data parallelism, tokens sent to their expert's rank and
back with all-to-all: `dsnd.moe.experts`), the capacity that drops rows past an expert's share
(`capacity`), the routers' load counting (`router_load`), their load-balancing loss
(`router_aux`), and the step's numbers the trainer asks for once (`numbers`).
"""

from dsnd.moe.counts import expert_counts
from dsnd.moe.experts import ExpertParallel, ParallelExperts, moe_experts, parallelize_experts

__all__ = [
    "ExpertParallel",
    "ParallelExperts",
    "expert_counts",
    "moe_experts",
    "parallelize_experts",
]
