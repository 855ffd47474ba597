"""The DeepSpeed boundary: the only part of dsnd that reads DeepSpeed's internals.

It imports torch and DeepSpeed only, any other part of dsnd may import it, and no other part
imports DeepSpeed (tests/unit/test_layering.py). A DeepSpeed upgrade is a read of this package.
DeepSpeed's public calls go through `public` (`deepspeed.zero.Init` / `GatheredParameters`,
Ulysses' `DistributedAttention`, `init_distributed`, `comm.log_summary`, the accelerator) and
`pipe` (dsnd's layer specs as `deepspeed.pipe.LayerSpec` / `TiedLayerSpec`, DeepSpeed's own
`PipelineModule` and engine, for the benchmark against it); the rest of dsnd uses the engine's
`bfloat16_enabled`, `module`, `device`, `optimizer.param_groups`, `lr_scheduler`,
`get_global_grad_norm`, `destroy`.
The step itself (forward, backward, reduction, optimizer step) goes through `stage_engine`.

Modules and the private (or `deepspeed.runtime`) names each touches, with why:
- `stage_engine`: the engine's `coalesce_grad_reduction`, `set_gradient_accumulation_boundary`,
  `allreduce_gradients`, `gradient_accumulation_steps`, `zero_optimization_stage`, `backward`,
  `step` (public methods, in the order a pipeline step needs them), and torch's private
  `torch.distributed.pipelining._backward.stage_backward_input` / `stage_backward_weight` for
  the split backward of zero-bubble schedules (torch's own implementation, not a copy); and
  ZeRO-3 parameters' `ds_active_sub_modules` (the set DeepSpeed partitions a parameter by when
  it empties), claimed for a whole step under `parallel.reshard_after_forward: false`.
- `build`: `deepspeed.runtime.utils.is_model_parallel_parameter`, the rule DeepSpeed's own
  gradient norm uses to count a tensor-parallel-replicated parameter once.
- `compat`: `assert_ints_same_as_other_ranks` as imported into `deepspeed.runtime.zero.utils`,
  `.stage3`, `.partition_parameters`, `.partitioned_param_coordinator`, replaced by a copy
  scoped to the stage's data-parallel group (the world-wide check hangs when pipeline stages
  hold different layers); `deepspeed.ops.op_builder.builder.OpBuilder.jit_load` wrapped to log
  op builds (with torch's `torch.utils.cpp_extension._get_build_directory`);
  `DeepSpeedCPUAdam.ds_opt_adam` / `opt_id` (its C++ op's per-optimizer beta powers, replayed
  on resume so an offloaded run resumes bit for bit); `FP16_UnfusedOptimizer`'s `fp16_groups` /
  `fp32_groups` and inner optimizer state (undoing the step its constructor takes); a
  parameter's `nvme_swapper` (one NVMe swapper per stage, handed to each layer's `zero.Init`);
  `deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP` (ZeRO++ hpZ's group, set to the
  stage's own).
- `loss_scale`: fp16's scaler on the optimizer, `loss_scaler` (ZeRO 1-3) or `loss_scale_config`
  (ZeRO-0's FP16 optimizers), its `cur_scale` / `cur_iter` / `last_overflow_iter` /
  `cur_hysteresis`, and the engine's `fp16_enabled`, `was_step_applied`, `skipped_steps`.
- `state`: `engine.optimizer.optimizer` (the torch optimizer inside ZeRO's wrapper), a
  parameter's `ds_id` / `_hp_mapping` (whether DeepSpeed keeps a separate fp32 master),
  `fp16_groups` / `fp32_groups` (bf16 at ZeRO-0), `fp32_partitioned_groups_flat` (ZeRO-3's flat
  masters, in the optimizer only around a step), `_lazy_init_hp_params_optimizer_state` and
  `_hp_optimizer_states_linked` (relinking ZeRO-1/2's state views; no public method exists);
  ZeRO-3's `swap_optimizer`, `_swappable_optimizer_subgroup`,
  `_optimizer_states_and_gradient_swap_in` / `_out` (NVMe: a sub-group read in while its state
  is created for loading).
  The public `deepspeed.utils.safe_{get,set}_full_{fp32_param,optimizer_state}` do the rest.
- `optimizers`: the class DeepSpeed's `_configure_basic_optimizer` builds for a JSON (its
  `deepspeed.ops` optimizers: `FusedAdam`, `DeepSpeedCPUAdam`, `DeepSpeedCPUAdagrad`,
  `DeepSpeedCPULion`, `FusedLion`, `FusedLamb`; mup's; `torch.optim`), whether the
  accelerator has its kernel (`deepspeed_api.op_problem`), a trial step of a torch
  optimizer on a tiny tensor (torch's own range errors before start), its state bytes.
- `ds_checkpoint`: `deepspeed.checkpoint.ds_to_universal.main` (DeepSpeed's own conversion of a
  saved checkpoint into a universal one, driven as its command line would), with its private
  `_inject_missing_state` replaced during the call (to add the pattern of pipeline-replicated
  tied modules, which `main` takes no other way), and the classes DeepSpeed's checkpoint files
  pickle, allowed for `torch.load(weights_only=True)`: `deepspeed.runtime.fp16.loss_scaler.
  LossScaler`, `deepspeed.runtime.zero.config.ZeroStageEnum`, `deepspeed.utils.tensor_fragment.
  fragment_address`.
- `experts`: `deepspeed.utils.groups._EXPERT_PARALLEL_GROUP` / `_EXPERT_DATA_PARALLEL_GROUP` and
  their `_RANKS` twins (set to the stage's expert groups), `deepspeed.moe.layer.MoE` (an empty
  subclass marks a stage as having MoE layers, so DeepSpeed's ZeRO 0-2 keep expert parameters in
  groups of their own), ZeRO-3's `_gradient_averaging_world_size` and `_get_norm_groups` and its
  `fp16_groups` / `dp_process_group` (experts averaged over the data-parallel size, their norm
  summed over the expert-parallel group), and the engine's `clip_fp32_gradients` (ZeRO-0's
  clipping by the replica's true norm).
- `memory`: `ds_tensor`, `single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`,
  `fp32_groups`, `grad_partitions_flat_buffer`, read (never changed) to count model-state bytes.
- `deepspeed_api`: `deepspeed.runtime.zero.config.DeepSpeedZeroConfig`,
  `deepspeed.runtime.precision_config.DeepSpeedBF16Config`, `deepspeed.runtime.config.
  DeepSpeedConfig` (a JSON checked by the code that will read it), `deepspeed.runtime.
  lr_schedules`, `deepspeed.runtime.pipe.topology.
  PipeModelDataParallelTopology`, a parameter's `ds_shape` (its shape before ZeRO-3),
  `deepspeed.runtime.swap_tensor.aio_config.AIO_DEFAULT_DICT` (the `aio` keys DeepSpeed reads)
  and `AsyncIOBuilder.is_compatible` (whether NVMe offload's op can be built: libaio),
  `deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS` (DeepSpeed's optimizer names) and
  `deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS` (those ZeRO runs without
  `zero_allow_untested_optimizer`).
"""
