"""The model-parallel unit ("mpu") DeepSpeed expects, answered from dsnd's own groups.

DeepSpeed reads the data-parallel group from it (ZeRO shards and reduces over it) and the
model-parallel group (gradient norms of tensor-split parameters are summed over it). Here "model
parallel" means the tensor-parallel slice of one stage, what DeepSpeed's `PipelineParallelGrid`
calls "slice". The grid's own get_model_parallel_* span pipe x tensor, and DeepSpeed's norm code
(ZeRO-0 clipping, ZeRO-3) counts replicated parameters only on model-parallel rank 0, which would
drop every later stage's gradients; pipeline stages are joined by dsnd's executor, not DeepSpeed.
"""

from __future__ import annotations

import torch.distributed as dist

from dsnd.dist.groups import ProcessGroups


class Mpu:
    def __init__(self, groups: ProcessGroups) -> None:
        self.groups = groups

    # data parallel: ZeRO partitions and gradient reduction
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.data

    def get_data_parallel_rank(self) -> int:
        return self.groups.coord.dp

    def get_data_parallel_world_size(self) -> int:
        return self.groups.topology.dp

    # tensor ("model", "slice") parallel
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tensor

    def get_model_parallel_rank(self) -> int:
        return self.groups.coord.tp

    def get_model_parallel_world_size(self) -> int:
        return self.groups.topology.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

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
