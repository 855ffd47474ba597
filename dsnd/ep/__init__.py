"""Expert parallelism: the experts of each MoE layer computed over an expert-parallel group
carved out of data parallelism (`dsnd.topology.Topology.expert_groups`), tokens sent to the
rank that computes their expert and back with all-to-all (`dsnd.ep.experts`)."""

from dsnd.ep.counts import expert_counts
from dsnd.ep.experts import ExpertParallel, ParallelExperts, moe_experts, parallelize_experts

__all__ = ["ExpertParallel", "ParallelExperts", "expert_counts", "moe_experts",
           "parallelize_experts"]
