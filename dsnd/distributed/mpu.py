"""The model-parallel unit ("mpu") DeepSpeed expects, answered from dsnd's own groups.

DeepSpeed reads two things from it:
- the data-parallel group: ZeRO shards and reduces over it (every rank of the stage holding the
  same parameters: data x context parallel). Its *world size*, though, is the number of sample
  replicas (dp): DeepSpeed checks ``train_batch_size = micro * gas * world size`` with it, and
  context-parallel ranks share their samples. DeepSpeed averages gradients by the group's own
  size (dp * cp), which is what each context-parallel rank's loss (its slice's share of the
  sequence mean, times cp: `dsnd.cp.loss`) needs;
- the model-parallel group and rank, used by every gradient-norm path (ZeRO-0 clipping, ZeRO 1-3):
  each rank sums the squared norms of its parameters, counting a parameter that is not
  tensor-split only where the model-parallel rank is 0, then all-reduces over the group.

So that the norm (and clipping) covers ALL pipeline stages, dsnd's model-parallel group is one
whole model replica (pipe x tensor: `ProcessGroups.model`), while the model-parallel rank is the
tensor-parallel rank: a replicated parameter is counted once per stage, never dropped. DeepSpeed's
own `PipelineParallelGrid` answers the grid's pipe x tensor rank instead, which counts replicated
parameters on stage 0 only (the grid's answers against dsnd's: `tests/distributed/test_groups.py`,
test_model_parallel_rank_is_the_tensor_rank_not_the_replica_rank).
"""

from __future__ import annotations

import torch.distributed as dist

from dsnd.distributed.groups import ProcessGroups


class Mpu:
    def __init__(self, groups: ProcessGroups) -> None:
        self.groups = groups

    # data parallel: ZeRO partitions and gradient reduction
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.data

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.groups.data)

    def get_data_parallel_world_size(self) -> int:
        return self.groups.topology.dp  # sample replicas (see above)

    # model parallel: one replica (pipe x tensor) for norms; rank = tensor rank (see above)
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.replica

    def get_model_parallel_rank(self) -> int:
        return self.groups.coord.tp

    def get_model_parallel_world_size(self) -> int:
        return self.groups.topology.pp * self.groups.topology.tp

    # tensor ("slice") parallel
    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tensor

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.coord.tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.topology.tp

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self.groups.tensor)[0]

    # pipeline
    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.pipe

    def get_pipe_parallel_rank(self) -> int:
        return self.groups.coord.pp

    def get_pipe_parallel_world_size(self) -> int:
        return self.groups.topology.pp

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
