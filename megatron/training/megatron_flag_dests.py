"""Megatron-LM 0.19.2's dest names and defaults for the flags of ``megatron_flag_table`` (the flags
that are not fields of our configs), read from the released megatron-core 0.19.2 wheel's
``add_megatron_arguments``. ``megatron_args.parse_args`` sets each of them on its namespace, so that
code written against Megatron-LM's ``args`` finds every attribute it reads (``args.moe_enable_deepep``
is False here, as there, and stays False: the flag is refused). Dests of flags that are now fields of
our configs (the MoE flags) are set from the configs instead (``megatron_args``).
"""

from __future__ import annotations

from typing import Any

# flag -> dest, where the dest is not the flag's own name (``--disable-x`` storing ``x``, ...).
RENAMED: dict[str, str] = {
    "--bert-no-binary-head": "bert_binary_head",
    "--ckpt-fully-parallel-save": "ckpt_fully_parallel_save_deprecated",
    "--cuda-graph-scope": "cuda_graph_scope_deprecated",
    "--disable-align-grad-reduce": "align_grad_reduce",
    "--disable-ckpt-load-validate-sharding-integrity": "ckpt_load_validate_sharding_integrity",
    "--disable-clone-scatter-output-in-embedding": "clone_scatter_output_in_embedding",
    "--disable-dsa-indexer-rotate-activation": "dsa_indexer_rotate_activation",
    "--disable-dsa-indexer-scoring-relu": "dsa_indexer_scoring_relu",
    "--disable-flight-recorder-dump-on-timeout": "flight_recorder_dump_on_timeout",
    "--disable-flight-recorder-extra-dump-on-exec": "flight_recorder_extra_dump_on_exec",
    "--disable-flight-recorder-include-only-active": "flight_recorder_include_only_active",
    "--disable-fp8-wgrad": "fp8_wgrad",
    "--disable-gloo-process-groups": "use_gloo_process_groups",
    "--disable-mamba-mem-eff-path": "use_mamba_mem_eff_path",
    "--disable-manual-gc-eval": "manual_gc_eval",
    "--disable-msc": "disable_msc_deprecated",
    "--disable-stream-ckpt-dequant": "stream_ckpt_dequant",
    "--disable-strict-fsdp-dtensor-load": "strict_fsdp_dtensor_load",
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": "tokenizer_sentencepiece_ignore_extra_whitespaces",
    "--disable-tp-comm-bulk-dgrad": "tp_comm_bulk_dgrad",
    "--disable-tp-comm-bulk-wgrad": "tp_comm_bulk_wgrad",
    "--disable-tp-comm-overlap-ag": "tp_comm_overlap_ag",
    "--disable-tp-comm-overlap-rs": "tp_comm_overlap_rs",
    "--disable-tp-comm-split-ag": "tp_comm_split_ag",
    "--disable-tp-comm-split-rs": "tp_comm_split_rs",
    "--disable-use-tokenizer-model-from-checkpoint-args": "use_tokenizer_model_from_checkpoint_args",
    "--dist-ckpt-format": "dist_ckpt_format_deprecated",
    "--fp4-format": "fp4",
    "--inference-dynamic-batching-prefix-caching": "inference_dynamic_batching_enable_prefix_caching",
    "--muon-no-split-qkv": "muon_split_qkv",
    "--no-align-grad-reduce": "align_grad_reduce",
    "--no-align-param-gather": "align_param_gather",
    "--no-barrier-with-level-1-timing": "barrier_with_L1_time",
    "--no-bias-dropout-fusion": "bias_dropout_fusion",
    "--no-bias-swiglu-fusion": "bias_swiglu_fusion",
    "--no-ckpt-fully-parallel-save": "ckpt_fully_parallel_save",
    "--no-ckpt-load-validate-sharding-integrity": "ckpt_load_validate_sharding_integrity",
    "--no-clone-scatter-output-in-embedding": "clone_scatter_output_in_embedding",
    "--no-data-sharding": "data_sharding",
    "--no-dsa-indexer-rotate-activation": "dsa_indexer_rotate_activation",
    "--no-dsa-indexer-scoring-relu": "dsa_indexer_scoring_relu",
    "--no-flight-recorder-dump-on-timeout": "flight_recorder_dump_on_timeout",
    "--no-flight-recorder-extra-dump-on-exec": "flight_recorder_extra_dump_on_exec",
    "--no-flight-recorder-include-only-active": "flight_recorder_include_only_active",
    "--no-fp8-wgrad": "fp8_wgrad",
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "--no-gradient-reduce-div-fusion": "gradient_reduce_div_fusion",
    "--no-inference-disable-ep-consensus": "inference_disable_ep_consensus",
    "--no-inference-dynamic-batching-prefix-caching": "inference_dynamic_batching_enable_prefix_caching",
    "--no-inference-text-gen-server-logging": "inference_text_gen_server_logging",
    "--no-inference-use-synchronous-zmq-collectives": "inference_use_synchronous_zmq_collectives",
    "--no-inference-wandb-logging": "inference_wandb_logging",
    "--no-initialization": "perform_initialization",
    "--no-manual-gc-eval": "manual_gc_eval",
    "--no-masked-softmax-fusion": "masked_softmax_fusion",
    "--no-one-logger": "enable_one_logger",
    "--no-pin-cpu-grads": "pin_cpu_grads",
    "--no-pin-cpu-params": "pin_cpu_params",
    "--no-rl-inference-logprobs-is-correction": "rl_inference_logprobs_is_correction",
    "--no-rl-offload-inference-model-weights-when-idle": "rl_offload_inference_model_weights_when_idle",
    "--no-rl-partial-rollouts": "rl_partial_rollouts",
    "--no-rl-persist-cuda-graphs": "rl_persist_cuda_graphs",
    "--no-rl-skip-bos-token": "rl_skip_bos_token",
    "--no-rl-training-cuda-graphs": "rl_training_cuda_graphs",
    "--no-rl-use-sequence-packing": "rl_use_sequence_packing",
    "--no-rl-verify-model-weights-swap": "rl_verify_model_weights_swap",
    "--no-rope-fusion": "apply_rope_fusion",
    "--no-stream-ckpt-dequant": "stream_ckpt_dequant",
    "--no-strict-fsdp-dtensor-load": "strict_fsdp_dtensor_load",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": "tokenizer_sentencepiece_ignore_extra_whitespaces",
    "--no-tp-comm-bulk-dgrad": "tp_comm_bulk_dgrad",
    "--no-tp-comm-bulk-wgrad": "tp_comm_bulk_wgrad",
    "--no-tp-comm-overlap-ag": "tp_comm_overlap_ag",
    "--no-tp-comm-overlap-rs": "tp_comm_overlap_rs",
    "--no-tp-comm-split-ag": "tp_comm_split_ag",
    "--no-tp-comm-split-rs": "tp_comm_split_rs",
    "--no-use-layer-wise-param-layout": "use_layer_wise_param_layout",
    "--no-use-tokenizer-model-from-checkpoint-args": "use_tokenizer_model_from_checkpoint_args",
    "--no-yarn-correction-range-round-to-int": "yarn_correction_range_round_to_int",
    "--overlap-p2p-communication-warmup-flush": "overlap_p2p_comm_warmup_flush",
    "--tokenizer-metadata": "metadata_path",
    "--tokenizer-special-tokens": "special_tokens",
    "--torch-fsdp2-no-reshard-after-forward": "torch_fsdp2_reshard_after_forward",
    "--use-dist-ckpt": "use_dist_ckpt_deprecated",
    "--use-mcore-models": "deprecated_use_mcore_models",
    "--use-nccl-ub": "nccl_ub",
    "--use-same-sampling-seed-across-dp-ranks": "offset_sampling_seed_by_dp_rank",
}

# Dests whose default is False / True (switches, mostly).
FALSE: frozenset[str] = frozenset(
    """
accumulate_allreduce_grads_in_fp32 adlr_autoresume allow_ambiguous_pad_tokens apply_query_key_layer_scaling
apply_residual_connection_post_layernorm apply_wd_to_qk_layernorm async_ckpt_use_cpu_shm
attention_output_gate attention_softmax_in_fp32 auto_detect_ckpt_format batch_invariant_mode
biencoder_shared_query_context_model cache_mla_latents calc_ft_timeouts check_for_large_grads
check_for_spiky_loss checkpoint_activations ckpt_assume_constant_structure
ckpt_convert_update_legacy_dist_opt_format ckpt_fully_parallel_load ckpt_fully_parallel_save_deprecated
cpu_offloading_retain_pinned_cpu_buffers create_all_gather_group data_parallel_random_init
dataloader_defer_npy_index_mmap dataloader_fast_cache_load dataloader_inter_document_masking
ddp_pad_buckets_for_high_nccl_busbw ddp_reduce_scatter_with_fp32_accumulation decode_only_cuda_graphs
decrease_batch_size_if_needed defer_embedding_wgrad_compute delay_offload_until_cuda_graph delay_wgrad_compute
deprecated_use_mcore_models deterministic_mode dino_norm_last_layer disable_jit_fuser disable_msc_deprecated
disable_straggler_on_startup disable_symmetric_registration dist_ckpt_optim_fully_reshardable
dist_ckpt_save_pre_mcore_014 distrib_optim_fully_reshardable_mem_efficient distribute_saved_activations
dsa_indexer_k_norm_fp32 dsa_indexer_rope_interleaved dsa_indexer_use_sparse_loss enable_chunked_prefill
enable_cuda_graph enable_experimental enable_ft_package enable_full_sharding_in_hsdp enable_msc
ep_overlap_early_attn_memory_release exit_signal_handler_for_dataloader exit_signal_handler_for_training
external_cuda_graph fake_process_group fim_data fine_grained_activation_offloading flash_decode
flight_recorder_include_stack_trace fp16_lm_cross_entropy fp32_residual_connection fp4_param_gather
fp8_output_proj fp8_param_gather freeze_all_layers fsdp_db_use_persist_buf_on_alloc_fail fsdp_double_buffer
fsdp_manual_registration full_validation fused_residual_rmsnorm grpo_filter_groups_with_same_reward
high_priority_a2a_comm_stream hybrid_context_parallel inference_cuda_graph_all_prefills
inference_disable_ep_consensus inference_disable_triton_nvls_kernels inference_dynamic_batching
inference_dynamic_batching_enable_prefix_caching inference_dynamic_batching_track_generated_token_events
inference_dynamic_batching_track_paused_request_events inference_fuse_tp_communication
inference_moe_disable_fused_quant_kernels inference_rng_tracker inference_text_gen_server_logging
inference_use_synchronous_zmq_collectives inference_wandb_logging init_method_xavier_uniform
init_model_with_meta_device inprocess_empty_cuda_cache inprocess_restart is_hybrid_model
keep_fp8_transpose_cache lazy_mpu_init load_main_params_from_ckpt log_device_memory_used log_energy
log_max_attention_logit log_memory_to_tensorboard log_straggler log_timers_to_tensorboard
log_validation_ppl_to_tensorboard logits_load_ignore_errors manual_gc
megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_max_pool_double_buffer mla_down_proj_fusion
moe_apply_probs_on_input moe_enable_deepep moe_enable_routing_replay moe_grouped_gemm
moe_hybridep_pad_uneven_dispatch_inputs moe_layer_recompute moe_ncclep_static_shape moe_ncclep_zero_copy
moe_pad_expert_input_to_capacity moe_pad_experts_for_cuda_graph_inference moe_paged_stash
moe_per_layer_logging moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_enable_expert_bias
moe_router_force_load_balancing moe_router_fusion moe_router_padding_for_fp8
moe_router_padding_for_quantization moe_router_pre_softmax moe_routing_trace_capture_hidden_states
moe_routing_trace_capture_logits moe_routing_trace_dump_weights moe_shared_expert_gate
moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight moe_use_upcycling mtp_detach_heads
mtp_standalone mtp_use_repeated_layer multi_latent_attention multiple_validation_sets muon_nesterov
nccl_all_reduce_for_prefill nccl_ub no_persist_layer_norm nvtx_ranges one_logger_async openai_gelu
optimizer_cpu_offload optimizer_cuda_graph output_bert_embeddings overlap_cpu_optimizer_d2h_h2d
overlap_dispatch_backward_with_experts_wgrad overlap_moe_expert_parallel_comm overlap_p2p_comm_warmup_flush
overlap_param_gather_with_optimizer_step perform_rl_step pytorch_profiler_collect_chakra qk_clip qk_l2_norm
quick_geglu record_memory_history record_shapes replication retriever_score_scaling
reuse_grad_buf_for_mxfp8_param_ag rl_inference_logprobs_is_correction
rl_offload_inference_model_weights_when_idle rl_offload_optimizer_during_inference rl_partial_rollouts
rl_persist_cuda_graphs rl_profile rl_skip_bos_token rl_training_cuda_graphs rl_use_sequence_packing
rl_verify_model_weights_swap rotary_interleaved run_workload_inspector_server sft squared_relu te_rng_tracker
test_mode tokenizer_hf_no_include_special_tokens tokenizer_hf_no_use_fast tokenizer_sentencepiece_legacy
tp_comm_overlap tp_comm_overlap_rs_dgrad trust_remote_code use_dist_ckpt_deprecated
use_flash_attn use_fused_weighted_squared_relu use_grouped_gemm_for_dense_mlp
use_grouped_gemm_for_shared_expert use_kitchen_attention use_legacy_static_engine use_megatron_fsdp
use_mp_args_from_checkpoint_args use_mup use_one_sent_docs use_persistent_ckpt_worker
use_precision_aware_optimizer use_ring_exchange_p2p use_sharp use_te_activation_func
use_torch_fsdp2 use_torch_optimizer_for_cpu_offload use_tp_pp_dp_mapping use_transformer_engine_op_fuser
verify_integrity vision_pretraining
""".split()
)
TRUE: frozenset[str] = frozenset(
    """
align_grad_reduce align_param_gather apply_rope_fusion barrier_with_L1_time bert_binary_head
bias_dropout_fusion bias_swiglu_fusion ckpt_fully_parallel_save ckpt_load_validate_sharding_integrity
clone_scatter_output_in_embedding data_sharding dsa_indexer_rotate_activation dsa_indexer_scoring_relu
enable_one_logger flight_recorder_dump_on_timeout flight_recorder_extra_dump_on_exec
flight_recorder_include_only_active fp8_wgrad gradient_accumulation_fusion gradient_reduce_div_fusion
manual_gc_eval masked_softmax_fusion muon_split_qkv offset_sampling_seed_by_dp_rank perform_initialization
pin_cpu_grads pin_cpu_params stream_ckpt_dequant strict_fsdp_dtensor_load
tokenizer_sentencepiece_ignore_extra_whitespaces torch_fsdp2_reshard_after_forward tp_comm_bulk_dgrad
tp_comm_bulk_wgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_split_ag tp_comm_split_rs
use_gloo_process_groups use_layer_wise_param_layout use_mamba_mem_eff_path
use_tokenizer_model_from_checkpoint_args yarn_correction_range_round_to_int
""".split()
)

# The other dests with a default that is not None.
DEFAULTS: dict[str, Any] = {
    "activation_offload_fraction": 1.0,
    "adlr_autoresume_interval": 1000,
    "app_tag_run_version": "0.0.0",
    "async_ckpt_cpu_priority": 10,
    "async_ckpt_io_priority": 3,
    "async_strategy": "nvrx",
    "attention_backend": "auto",
    "bert_embedder_type": "megatron",
    "biencoder_projection_dim": 0,
    "ckpt_fully_parallel_load_exchange_algo": "broadcast",
    "ckpt_fully_parallel_load_process_group": "dp",
    "ckpt_fully_parallel_save_process_group": "dp",
    "classes_fraction": 1.0,
    "config_logger_dir": "",
    "context_parallel_size": 1,
    "cp_comm_type": ["p2p"],
    "cpu_offloading_num_layers": 0,
    "cross_entropy_fusion_impl": "native",
    "cuda_graph_impl": "none",
    "cuda_graph_modules": [],
    "cuda_graph_warmup_steps": 3,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "data_per_class_fraction": 1.0,
    "ddp_param_name_patterns_for_fp32_local_accumulation": [],
    "delta_offload_bytes_across_pp_ranks": 0,
    "dino_bottleneck_size": 256,
    "dino_freeze_last_layer": 1,
    "dino_head_hidden_size": 2048,
    "dino_local_crops_number": 10,
    "dino_local_img_size": 96,
    "dino_teacher_temp": 0.07,
    "dino_warmup_teacher_temp": 0.04,
    "dino_warmup_teacher_temp_epochs": 30,
    "dist_ckpt_strictness": "assume_ok_unexpected",
    "dist_ckpt_workers": 1,
    "dsa_indexer_skip_topk_offset": 0,
    "dsa_indexer_topk_freq": 1,
    "dsa_kernel_backend": "none",
    "empty_unused_memory_level": 0,
    "error_injection_rate": 0,
    "error_injection_type": "transient_error",
    "exp_avg_dtype": "fp32",
    "exp_avg_sq_dtype": "fp32",
    "expert_model_parallel_size": 1,
    "fim_eod_token": "<|endoftext|>",
    "fim_middle_token": "<fim_middle>",
    "fim_pad_token": "<fim_pad>",
    "fim_prefix_token": "<fim_prefix>",
    "fim_rate": 0.5,
    "fim_spm_rate": 0.5,
    "fim_suffix_token": "<fim_suffix>",
    "flight_recorder_trace_buffer_size": 2000,
    "fp4_recipe": "nvfp4",
    "fp8_interval": 1,
    "fp8_margin": 0,
    "ft_num_warmup_iters": 5,
    "glu_linear_offset": 0.0,
    "grpo_clamp_eps_lower": 0.01,
    "grpo_clamp_eps_upper": 0.01,
    "grpo_entropy_term_weight": 0.0,
    "grpo_group_size": 2,
    "grpo_iterations": 2,
    "grpo_kl_beta": 0.001,
    "grpo_prompts_per_step": 32,
    "head_lr_mult": 1.0,
    "high_priority_stream_groups": [],
    "img_h": 224,
    "img_w": 224,
    "indexer_batch_size": 128,
    "indexer_log_interval": 1000,
    "inference_batch_times_seqlen_threshold": -1,
    "inference_cuda_graph_max_tokens": 512,
    "inference_dynamic_batching_async_sched_mode": "legacy",
    "inference_dynamic_batching_block_size": 256,
    "inference_dynamic_batching_buffer_size_gb": 40.0,
    "inference_dynamic_batching_cuda_graph_mixed_prefill_count": 16,
    "inference_dynamic_batching_cuda_graph_sizing_distribution": "exponential",
    "inference_dynamic_batching_logprobs_mode": "raw_logprobs",
    "inference_dynamic_batching_num_cuda_graphs": 16,
    "inference_dynamic_batching_prefix_caching_coordinator_policy": "load_balanced",
    "inference_dynamic_batching_prefix_caching_eviction_policy": "ref_zero",
    "inference_dynamic_batching_prefix_caching_routing_alpha": 0.5,
    "inference_dynamic_batching_sampling_backend": "torch",
    "inference_dynamic_batching_unified_memory_level": 0,
    "inference_grouped_gemm_backend": "vllm",
    "inference_logging_step_interval": 0,
    "inference_max_requests": 8,
    "inference_max_seq_length": 2560,
    "inference_moe_token_dispatcher_type": "nvls",
    "inprocess_active_world_size": 1,
    "inprocess_barrier_timeout": 120,
    "inprocess_completion_timeout": 120,
    "inprocess_granularity": "node",
    "inprocess_hard_timeout": 90,
    "inprocess_heartbeat_interval": 30,
    "inprocess_heartbeat_timeout": 60,
    "inprocess_last_call_wait": 1,
    "inprocess_monitor_process_interval": 1.0,
    "inprocess_monitor_thread_interval": 1.0,
    "inprocess_progress_watchdog_interval": 1.0,
    "inprocess_soft_timeout": 60,
    "inprocess_termination_grace_time": 1,
    "iter_per_epoch": 1250,
    "iterations_to_skip": [],
    "kitchen_attention_backend": "sdpa",
    "kv_lora_rank": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "lion_beta1": 0.95,
    "lion_beta2": 0.98,
    "local_rank": 0,
    "logits_load_decode_threads": 4,
    "logits_load_kd_loss_alpha": 1.0,
    "logits_load_msc_prefetch_depth": 2,
    "logits_load_prefetch_factor": 3,
    "logits_save_dtype": "fp16",
    "logits_save_top_p_min_k": 1,
    "main_grads_dtype": "fp32",
    "main_params_dtype": "fp32",
    "mamba_head_dim": 64,
    "mamba_inference_conv_states_dtype": "bf16",
    "mamba_inference_ssm_states_dtype": "bf16",
    "mamba_num_groups": 8,
    "mamba_state_dim": 128,
    "manual_gc_interval": 0,
    "mask_factor": 1.0,
    "mask_prob": 0.15,
    "mask_type": "random",
    "max_tokens_to_oom": 12000,
    "megatron_fsdp_grad_comm_dtype": "auto",
    "megatron_fsdp_main_grads_dtype": "auto",
    "megatron_fsdp_main_params_dtype": "fp32",
    "memory_snapshot_path": "snapshot.pickle",
    "min_offloaded_tensor_size": 1048576,
    "mlp_chunks_for_prefill": 1,
    "mlp_chunks_for_training": 1,
    "moe_aux_loss_coeff": 0.0,
    "moe_flex_dispatcher_backend": "deepep",
    "moe_hybridep_num_sms_preprocessing": 108,
    "moe_layer_freq": 1,
    "moe_paged_stash_buffer_size_factor_cpu": 0.0,
    "moe_paged_stash_buffer_size_factor_cuda": 1.1,
    "moe_paged_stash_page_size": 64,
    "moe_router_bias_update_rate": 0.001,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_router_quantile_balancing_ema": 0.0,
    "moe_router_score_function": "softmax",
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_token_drop_policy": "probs",
    "moe_upcycling_granularity": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "mtp_loss_scaling_factor": 0.1,
    "muon_coefficient_type": "quintic",
    "muon_extra_scale_factor": 1.0,
    "muon_fp32_matmul_prec": "medium",
    "muon_momentum": 0.9,
    "muon_num_ns_steps": 5,
    "muon_scalar_optimizer": "adam",
    "muon_scale_mode": "spectral",
    "muon_tp_mode": "blockwise",
    "mup_attn_scale_power": 1.0,
    "mup_embedding_mult": 1.0,
    "mup_output_mult": 1.0,
    "mup_width_mult": 1.0,
    "non_persistent_local_ckpt_algo": "fully_parallel",
    "null_tokenizer_pad_id": -1,
    "num_channels": 3,
    "num_classes": 1000,
    "num_dataset_builder_threads": 1,
    "num_distributed_optimizer_instances": 1,
    "num_speculative_tokens": 0,
    "offload_modules": [],
    "one_logger_project": "megatron-lm",
    "optimizer_offload_fraction": 1.0,
    "outer_dp_sharding_strategy": "no_shard",
    "patch_dim": 16,
    "qk_clip_alpha": 0.5,
    "qk_clip_threshold": 100,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "query_in_block_prob": 0.1,
    "refit_method": "gloo",
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "replication_factor": 2,
    "rerun_mode": "validate_results",
    "retriever_report_topk_accuracies": [],
    "rl_consumption_granularity": "B",
    "rl_default_temperature": 1.0,
    "rl_default_top_k": -1,
    "rl_default_top_p": 0,
    "rl_generation_lag": 0,
    "rl_inference_model_unified_memory_level": 0,
    "rl_inference_parsers": [],
    "rl_kv_cache_management_mode": "persist",
    "rl_prompts_per_eval": 32,
    "rl_sequence_packing_algo": "fifo",
    "rl_sequence_packing_max_sequences_per_bin": 50,
    "rl_submission_granularity": "B",
    "rotary_scaling_factor": 1.0,
    "sample_rate": 1.0,
    "sft_tokenizer_prompt_format": "nemotron-h-aligned",
    "short_seq_prob": 0.1,
    "softmax_type": "vanilla",
    "straggler_ctrlr_port": 65535,
    "straggler_minmax_count": 1,
    "swin_backbone_type": "tiny",
    "tensorboard_log_interval": 1,
    "tensorboard_queue_size": 1000,
    "timing_log_level": 0,
    "timing_log_option": "minmax",
    "tp_comm_bootstrap_backend": "nccl",
    "v_head_dim": 128,
    "vision_backbone_type": "vit",
    "vision_pretraining_type": "classify",
    "vocab_extra_ids": 0,
    "wgrad_deferral_limit": 0,
}


def dest_of(flag: str) -> str:
    """The dest Megatron-LM stores ``flag`` under."""
    return RENAMED.get(flag, flag[2:].replace("-", "_"))


def default_of(dest: str) -> Any:
    """Megatron-LM's default for ``dest`` (None where it has none)."""
    if dest in FALSE:
        return False
    if dest in TRUE:
        return True
    value = DEFAULTS.get(dest)
    return list(value) if isinstance(value, list) else value
