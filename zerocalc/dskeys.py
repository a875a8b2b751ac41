"""Every key of DeepSpeed 0.19.8's ds_config, classified: what zerocalc does with it.

KEYS maps a dotted key path to (class, default, why). The classes:

- "modelled": read, and the answer follows it;
- "no_effect": changes neither memory nor communication; accepted silently;
- "not_modelled": DeepSpeed acts on it and memory or traffic moves, zerocalc does not follow: a value
  other than `default` (null and "auto" are the default) is named in a warning;
- "refused": DeepSpeed 0.19.8 refuses it (`default` None: any value; else any value but the default).

`P.*` classifies the block P and everything in it, unless a longer path has its own entry.
`tests/test_dsconfig_schema.py` walks DeepSpeed's own config classes and fails on a key missing here;
docs/inputs.md lists this table (`python -m validate docs`).
"""
M, N, W, R = "modelled", "no_effect", "not_modelled", "refused"

_LOG = "logging, monitoring or profiling output"
_CKPT = "saving and loading checkpoints, outside the training step"
_BLOCK = "a block; its keys are listed one by one"
_ZPP = "ZeRO++ (hierarchical partitions, quantized weights or gradients): other shard sizes and wire bytes"
_REMOVED = "removed in DeepSpeed 0.19.8, which refuses it"
_OFFLOAD_BUF = "sizes the host or NVMe staging buffers of the offload"


def _inert(switch):
    return f"inert unless {switch} (warned about when set)"


KEYS = {
    # ---- batch, precision, optimizer -------------------------------------------------------------
    "train_batch_size": (M, None, "the global batch, with micro-batch and accumulation"),
    "train_micro_batch_size_per_gpu": (M, None, "activations and the allocation stream scale with it"),
    "gradient_accumulation_steps": (M, None, "the steps per optimizer step"),
    "fp16": (M, None, _BLOCK), "fp16.enabled": (M, None, "the parameter and gradient dtype"),
    "bf16": (M, None, _BLOCK), "bf16.enabled": (M, None, "the parameter and gradient dtype"),
    "bfloat16": (M, None, "the old name of bf16"), "bfloat16.enabled": (M, None, "the old name of bf16.enabled"),
    **{f"{b}.{k}": (N, None, "dynamic loss scaling: arithmetic on one scalar") for b in ("fp16",) for k in (
        "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale")},
    "fp16.auto_cast": (N, None, "casts the inputs of an fp16 model, whose weights are already fp16"),
    "fp16.fp16_master_weights_and_grads": (W, False, "fp16 master weights and gradients: other optimizer bytes"),
    **{f"{b}.{k}": v for b in ("bf16", "bfloat16") for k, v in {
        "check_grad_overflow": (N, None, "a check on the gradients' values"),
        "immediate_grad_update": (W, False, "the bf16 optimizer's gradient accumulation: other buffer lifetimes"),
        "bf16_master_weights_and_grads": (W, False, "bf16 master weights and gradients: other optimizer bytes"),
        "bf16_optimizer_states": (W, False, "bf16 optimizer states: other optimizer bytes")}.items()},
    "optimizer": (M, None, _BLOCK),
    "optimizer.type": (M, None, "the optimizer states' bytes (Adam, AdamW, Lamb, SGD; others warned about; the "
                                "removed 1-bit optimizers refused)"),
    "optimizer.params": (M, None, "SGD's momentum decides its state; learning rates and betas move no bytes"),
    "optimizer.legacy_fusion": (N, None, "an old fused-kernel switch; the states are the same"),
    "communication_data_type": (M, None, "the dtype of the gradient reductions"),
    "data_types": (M, None, _BLOCK),
    "data_types.grad_accum_dtype": (M, None, "the dtype gradients accumulate in"),
    "data_types.param_dtype": (W, None, "the parameters' storage dtype"),
    "data_types.buffer_dtype": (W, None, "the buffers' dtype"),
    "data_types.keep_in_fp32_modules": (W, "auto", "modules kept in fp32 under fp16/bf16"),
    "seq_parallel_communication_data_type": (N, None, "used only by sequence parallelism, "
                                                      + _inert("sequence_parallel_size")),
    "sequence_parallel_size": (W, 1, "Ulysses sequence parallelism: fewer data-parallel ranks, split activations"),
    "torch_autocast.enabled": (W, False, "torch.autocast: activations and reductions in a lower dtype"),
    "torch_autocast.*": (N, None, _inert("torch_autocast.enabled")),

    # ---- ZeRO ------------------------------------------------------------------------------------
    "zero_optimization": (M, None, _BLOCK),
    **{f"zero_optimization.{k}": (M, None, why) for k, why in {
        "stage": "what is partitioned", "reduce_bucket_size": "the gradient buckets and their collectives",
        "overlap_comm": "separate communication buffers", "contiguous_gradients": "a contiguous gradient buffer",
        "sub_group_size": "the optimizer's sub-groups (fp32 flat buffers at stage 3)",
        "offload_optimizer": "the optimizer states on the host or NVMe",
        "offload_param": "the parameters on the host or NVMe",
        "cpu_offload": "the old spelling of offload_optimizer.device cpu",
        "cpu_offload_param": "the old spelling of offload_param.device cpu"}.items()},
    **{f"zero_optimization.{p}{k}": (M, None, why) for p in ("", "stage3_") for k, why in {
        "prefetch_bucket_size": "stage 3's prefetched parameters",
        "max_live_parameters": "stage 3's gathered parameters held at once",
        "max_reuse_distance": "when stage 3 frees a gathered parameter",
        "param_persistence_threshold": "small parameters stage 3 keeps whole",
        "model_persistence_threshold": "the cap on stage 3's persistent parameters"}.items()},
    **{f"zero_optimization.{k}": (W, d, _ZPP) for k, d in {
        "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False}.items()},
    **{f"zero_optimization.{p}{k}": v for p in ("", "stage3_") for k, v in {
        "module_granularity_threshold": (W, 0, "stage 3 fetches small modules whole, and keeps their data at "
                                               "release"),
        "use_all_reduce_for_fetch_params": (W, False, "stage 3 fetches by all-reduce: other wire bytes"),
        "allgather_sequential": (W, False, "stage 3 gathers one parameter at a time"),
        "gather_16bit_weights_on_model_save": (N, None, _CKPT)}.items()},
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (N, None, _CKPT),
    # runtime/utils.py `all_gather_dp_groups`: with torch's all_gather_into_tensor (every torch 2) each
    # group's partition goes in one call whatever the size; 2-rank CPU rows, tests/test_dskeys_measured.py
    "zero_optimization.allgather_bucket_size": (N, None, "one all-gather per parameter group whatever its size "
                                                         "(0.19.8 buckets only without all_gather_into_tensor); "
                                                         "odd values refused at stages 1-2"),
    # stage_1_and_2.py `average_tensor`; 2-rank CPU rows, tests/test_dskeys_measured.py (cpu-dskeys-b.csv)
    "zero_optimization.reduce_scatter": (W, True, "false: each gradient bucket all-reduced in place, the same "
                                                  "collectives; the bucket's flatten copy is not made (a transient: "
                                                  "the allocation stream moves) at stages 1-2"),
    "zero_optimization.allgather_partitions": (N, None, "read, used nowhere in 0.19.8 (the updated partitions are "
                                                        "all-gathered either way)"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (W, True, "false: each gradient bucket reduced to its "
                                                                   "owners, one `reduce` per rank, instead of one "
                                                                   "all-reduce at stages 1-2 (unless reduce_scatter "
                                                                   "is false)"),
    "zero_optimization.memory_efficient_linear": (W, True, "stage 3's linear layer that keeps no gathered weight "
                                                           "for backward"),
    "zero_optimization.legacy_stage1": (R, False, "the old stage 1 left DeepSpeed; true stops its engine"),
    "zero_optimization.compute_grad_norm": (N, None, "a norm reduced to one scalar"),
    "zero_optimization.round_robin_gradients": (N, None, "which rank's partition a gradient goes to; same bytes"),
    "zero_optimization.parameter_alignment": (N, None, "alignment padding of a few elements"),
    "zero_optimization.ignore_unused_parameters": (N, None, "a check on unused parameters"),
    "zero_optimization.load_from_fp32_weights": (N, None, _CKPT),
    "zero_optimization.elastic_checkpoint": (N, None, _CKPT),
    "zero_optimization.pipeline_loading_checkpoint": (N, None, _CKPT),
    "zero_optimization.override_module_apply": (N, None, "how module.apply sees partitioned parameters"),
    "zero_optimization.log_trace_cache_warnings": (N, None, _LOG),
    "zero_optimization.enable_sanity_checks": (N, None, "checks on stage 3's bookkeeping"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (N, None, "Muon only, an optimizer warned about as "
                                                                       "not modelled"),
    "zero_optimization.cpu_offload_use_pin_memory": (W, True, "the old spelling of the offloads' pin_memory"),
    "zero_optimization.zenflow": (W, None, "ZenFlow: a different offloaded optimizer step"),
    "zero_optimization.zenflow.*": (N, None, _inert("zero_optimization.zenflow")),
    "zero_optimization.leaf_module": (N, None, _BLOCK),
    **{f"zero_optimization.leaf_module.{k}": (W, [], "stage 3 fetches these modules whole")
       for k in ("classes", "names", "name_suffixes")},
    # false: DeepSpeed skips `pin_memory()` on the offload's host buffers; CPU ranks pin nothing either way
    # (cpu_accelerator.py), so the 2-rank CPU rows show no difference (tests/test_dskeys_measured.py)
    **{f"zero_optimization.offload_{b}.{k}": v for b in ("param", "optimizer") for k, v in {
        "device": (M, None, "none, cpu or nvme"), "nvme_path": (N, None, "where the NVMe files go"),
        "pin_memory": (W, True, "false: the offload's host buffers pageable, at their own sizes (pinned ones are "
                                "rounded up to a power of two); host memory only")}.items()},
    "zero_optimization.offload_param.buffer_count": (W, 5, _OFFLOAD_BUF),
    "zero_optimization.offload_param.buffer_size": (W, 100_000_000, _OFFLOAD_BUF),
    "zero_optimization.offload_param.max_in_cpu": (W, 1_000_000_000, "parameters kept on the host under NVMe"),
    "zero_optimization.offload_optimizer.buffer_count": (W, 4, _OFFLOAD_BUF),
    "zero_optimization.offload_optimizer.pipeline_read": (W, False, "overlapped NVMe reads: more staging buffers"),
    "zero_optimization.offload_optimizer.pipeline_write": (W, False, "overlapped NVMe writes: more staging buffers"),
    "zero_optimization.offload_optimizer.ratio": (W, 1.0, "partial offload: part of the states stays on the GPU"),
    "zero_optimization.offload_optimizer.super_offload": (W, False, "SuperOffload: a different offloaded step"),
    "zero_optimization.offload_optimizer.fast_init": (N, None, "how the offloaded states are first written"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (N, None, "host threads of the CPU optimizer"),
    **{f"zero_optimization.{k}": (R, None, _REMOVED)
       for k in ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")},

    # ---- parallelism and features DeepSpeed switches on -------------------------------------------
    "activation_checkpointing": (N, None, "switches nothing on (checkpointing is the model's code: "
                                          "--activation-checkpointing); its keys are listed one by one"),
    **{f"activation_checkpointing.{k}": (W, False, why) for k, why in {
        "partition_activations": "checkpoints split across model-parallel ranks",
        "cpu_checkpointing": "checkpoints kept on the host",
        "contiguous_memory_optimization": "checkpoints copied into one preallocated buffer"}.items()},
    "activation_checkpointing.number_checkpoints": (N, None, "sizes contiguous_memory_optimization's buffer, "
                                                             "warned about when set"),
    "activation_checkpointing.profile": (N, None, _LOG),
    "activation_checkpointing.synchronize_checkpoint_boundary": (N, None, "a device synchronize; no bytes"),
    "tensor_parallel.autotp_size": (W, 0, "automatic tensor parallelism for training: weights split across ranks"),
    "tensor_parallel.*": (N, None, _inert("tensor_parallel.autotp_size") + ", or for inference"),
    "expert_parallel.enabled": (W, False, "AutoEP: experts split across ranks"),
    "expert_parallel.*": (N, None, _inert("expert_parallel.enabled")),
    "use_data_before_expert_parallelism": (N, None, "which ranks form expert groups; the same bytes"),
    "hybrid_engine.enabled": (W, False, "the RLHF hybrid engine: inference containers beside training"),
    "hybrid_engine.*": (N, None, _inert("hybrid_engine.enabled")),
    "compile.deepcompile": (W, False, "DeepCompile: its own schedule of gathers, frees and offloads"),
    "compile.*": (N, None, "DeepCompile's passes, " + _inert("compile.deepcompile")),
    "weight_quantization.quantized_initialization": (W, {}, "weights quantized as zero.Init builds them"),
    "weight_quantization.*": (N, None, _inert("weight_quantization.quantized_initialization")),
    "managed_gradient_accumulation": (W, True, "false: the caller accumulates gradients, not the engine"),
    "data_efficiency.data_sampling.curriculum_learning.enabled": (W, False, "shorter sequences early in training"),
    "data_efficiency.data_sampling.dynamic_batching.enabled": (W, False, "batches sized by their tokens"),
    "data_efficiency.data_routing.random_ltd.enabled": (W, False, "random-LTD: layers see fewer tokens"),
    "data_efficiency.*": (N, None, "which samples are drawn, in what order; each part is inert unless its own "
                                   "enabled (warned about)"),
    "pipeline.*": (N, None, "read only by PipelineEngine, which a PipelineModule model brings; zerocalc models "
                            "data parallelism"),

    # ---- no effect on memory or traffic ------------------------------------------------------------
    "gradient_clipping": (N, None, "a global norm: one scalar reduced"),
    "prescale_gradients": (N, None, "divides before or after the reduction; the same bytes"),
    "gradient_predivide_factor": (N, None, "a scale factor; the same bytes"),
    "gradient_allreduce_op": (N, None, "sum or mean; the same bytes"),
    "disable_allgather": (N, None, "read, used nowhere in 0.19.8"),
    "vocabulary_size": (N, None, "read, used nowhere in 0.19.8's training engine"),
    "zero_allow_untested_optimizer": (N, None, "permission to use a client optimizer"),
    "zero_force_ds_cpu_optimizer": (N, None, "a check that the offloaded optimizer is DeepSpeed's CPU one"),
    "dataloader_drop_last": (N, None, "the data loader's last partial batch"),
    "disable_python_gc": (N, None, "when Python's garbage collector runs on the host"),
    "scheduler.*": (N, None, "the learning-rate schedule"),
    "checkpoint.*": (N, None, _CKPT), "datastates_ckpt.*": (N, None, _CKPT),
    "aio.*": (N, None, "the NVMe I/O queue: speed of NVMe offload, not bytes held or moved"),
    "autotuning.*": (N, None, "the autotuner launches its own runs; each run's config is what zerocalc reads"),
    **{f"{k}.*": (N, None, _LOG) for k in ("tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
                                          "flops_profiler", "timers")},
    **{k: (N, None, _LOG) for k in ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
                                   "log_level")},

    # ---- refused -----------------------------------------------------------------------------------
    **{k: (R, None, _REMOVED) for k in ("nebula", "compression_training", "amp", "quantize_training",
                                        "sparse_gradients", "eigenvalue", "sparse_attention", "elasticity",
                                        "graph_harvesting", "curriculum_learning", "progressive_layer_drop")},
}


def lookup(path: str):
    """(class, default, why) of a dotted key path: its own entry, else the nearest enclosing `P.*`; None
    when the table does not classify it."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        block = ".".join(parts[:n]) + ".*"
        if block in KEYS:
            return KEYS[block]
    return None


_PARENTS = {b.rsplit(".", n)[0] for b in (k.removesuffix(".*") for k in KEYS) for n in range(1, b.count(".") + 1)}


def leaves(cfg: dict):
    """(dotted path, value) of every key of a ds_config, in the file's order, descending into the blocks
    the table lists keys of (iterative: a deeply nested file must not overflow the stack)."""
    stack = [("", iter(cfg.items()))]
    while stack:
        at, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        path = f"{at}{item[0]}"
        yield path, item[1]
        if isinstance(item[1], dict) and path in _PARENTS:
            stack.append((path + ".", iter(item[1].items())))
