"""Which tests show each flag at work: `FLAG_TESTS` maps the argparse dest of every flag that is not refused under
both backends (see `REFUSED_FLAGS`) to tests that set it and assert what it changes (a result, a file, a log line,
an error), not merely that it parses. The forwarded `--sglang-*` / `--router-*` flags are left out: the
launch-command tests cover them. tests/unit/test_every_flag.py keeps the table complete and checks that each test
exists and passes its flag.

A test id is "<test file name>::<test function name>", the file found anywhere under tests/. Pure data: this module
imports nothing.
"""

FLAG_TESTS: dict[str, tuple[str, ...]] = {
    # ---- cluster layout and backends --------------------------------------------------------------------------
    "train_backend": ("test_actor_group.py::test_fsdp_rank_is_dp_rank",),
    "rollout_backend": (
        "test_engine_args.py::test_context_length_is_the_sglang_flag_on_sglang_and_the_model_config_on_cpu",
    ),
    "actor_num_nodes": ("test_arguments.py::test_colocate_turns_on_offload_and_shares_actor_gpus",),
    "actor_num_gpus_per_node": ("test_arguments.py::test_colocate_turns_on_offload_and_shares_actor_gpus",),
    "rollout_num_gpus": ("test_arguments.py::test_disaggregated_sglang_needs_rollout_num_gpus",),
    "rollout_num_gpus_per_engine": ("test_arguments.py::test_disaggregated_sglang_needs_rollout_num_gpus",),
    "num_gpus_per_node": ("test_flag_effects.py::test_an_engine_wider_than_a_node_is_refused",),
    "colocate": (
        "test_arguments.py::test_colocate_turns_on_offload_and_shares_actor_gpus",
        "test_fsdp_weight_sync.py::test_update_weights_makes_engine_match_trainer",
    ),
    "offload": ("test_arguments.py::test_offload_flag_without_colocate",),
    "offload_train": ("test_train_e2e.py::test_colocated_run_offloads_onloads_and_syncs_right_weights",),
    "offload_rollout": ("test_engine_client.py::test_sglang_server_args_multi_node_and_no_offload",),
    "train_env_vars": ("test_flag_effects_with_actors.py::test_train_env_vars_reach_the_trainer_processes",),
    "train_num_threads": ("test_arguments.py::test_thread_budget_over_core_count_warns",),
    "cpu_engine_num_threads": ("test_engine_client.py::test_cpu_engine_args_defaults_and_overrides",),
    "cpu_engine_max_running_requests": ("test_engine_client.py::test_cpu_engine_args_defaults_and_overrides",),
    "cpu_engine_max_queued_requests": (
        "test_engine_client.py::test_cpu_engine_args_forward_the_api_key_and_queue_limit",
    ),
    "distributed_backend": ("test_flags_behaviour.py::test_distributed_backend_nccl_needs_cuda",),
    "distributed_timeout_minutes": (
        "test_flag_effects_with_actors.py::test_distributed_timeout_is_the_process_group_timeout",
    ),
    "tensor_model_parallel_size": (
        "test_actor_group.py::test_hand_worked_layout",
        "test_megatron_actor.py::test_tp2_matches_tp1",
    ),
    "pipeline_model_parallel_size": ("test_actor_group.py::test_hand_worked_layout",),
    "context_parallel_size": ("test_flag_effects.py::test_context_parallel_size_groups_the_data_parallel_ranks",),
    "enable_mtp_training": (
        "test_megatron_mtp.py::test_the_actor_trains_the_mtp_layer_logs_its_loss_and_exports_it",
        "test_arguments.py::test_mtp_training_is_refused_where_it_cannot_train",
    ),
    "expert_model_parallel_size": (
        "test_flag_effects.py::test_megatron_precision_and_parallel_flags_reach_the_config",
    ),
    "sequence_parallel": ("test_flag_effects.py::test_megatron_precision_and_parallel_flags_reach_the_config",),
    # ---- weight sync and staleness ----------------------------------------------------------------------------
    "update_weight_transport": (
        "test_weight_sync_disk.py::test_disk_push_makes_engine_match_trainer",
        "test_fsdp_lora.py::test_pushes_send_only_the_adapter_which_the_engine_serves",
    ),
    "update_weight_disk_dir": (
        "test_weight_sync_disk.py::test_disk_push_makes_engine_match_trainer",
        "test_weight_sync_disk.py::test_unwritable_disk_dir_is_a_clear_error",
    ),
    "update_weight_disk_keep_files": ("test_weight_sync_disk.py::test_disk_push_makes_engine_match_trainer",),
    "custom_update_weight_post_write_path": ("test_weight_sync_disk.py::test_disk_push_makes_engine_match_trainer",),
    "update_weight_mode": (
        "test_delta_weight_sync.py::test_delta_push_makes_engine_bit_equal_with_fewer_bytes",
        "test_delta_weight_sync.py::test_refused_delta_is_followed_by_the_full_weights",
    ),
    "update_weight_delta_encoding": (
        "test_delta_weight_sync.py::test_delta_push_makes_engine_bit_equal_with_fewer_bytes",
    ),
    "update_weight_delta_checksum": (
        "test_delta_weight_sync.py::test_delta_push_makes_engine_bit_equal_with_fewer_bytes",
    ),
    "update_weight_local_checkpoint_dir": (
        "test_delta_weight_sync.py::test_delta_push_makes_engine_bit_equal_with_fewer_bytes",
    ),
    "update_weight_buffer_size": (
        "test_flag_effects_with_actors.py::test_update_weight_buffer_size_sizes_the_buckets",
    ),
    "check_weight_update_equal": (
        "test_flag_effects_with_actors.py::test_check_weight_update_equal_checks_the_first_push",
    ),
    "max_weight_staleness": ("test_fully_async.py::test_loop_hands_out_only_fresh_groups_and_loses_none",),
    "staleness_policy": ("test_fully_async.py::test_loop_hands_out_only_fresh_groups_and_loses_none",),
    "ref_update_interval": ("test_flags_behaviour.py::test_ref_update_interval_refreshes_the_reference",),
    "reset_optimizer_states": ("test_flags_behaviour.py::test_reset_optimizer_states_makes_each_rollout_a_fresh_adam",),
    "keep_old_actor": ("test_flags_behaviour.py::test_keep_old_actor_takes_old_log_probs_from_the_generating_weights",),
    # ---- trainer recipe ---------------------------------------------------------------------------------------
    "only_train_params_name_list": (
        "test_flags_behaviour.py::test_freeze_and_only_train_params_keep_the_other_weights",
    ),
    "freeze_params_name_list": ("test_flags_behaviour.py::test_freeze_and_only_train_params_keep_the_other_weights",),
    "freeze_indexer": ("test_fsdp_families.py::test_freeze_indexer_keeps_the_dsa_indexer_as_loaded",),
    "true_on_policy_mode": ("test_true_on_policy.py::test_engine_and_trainer_log_probs_are_bit_identical",),
    # ---- LoRA --------------------------------------------------------------------------------------------------
    "lora_rank": (
        "test_fsdp_lora.py::test_lora_steps_equal_peft_with_torch_adamw",
        "test_fsdp_lora.py::test_reference_is_the_base_model_without_a_copy",
        "test_megatron_lora_actor.py::test_megatron_lora_trains_only_the_adapter_as_fsdp_does",
        "test_megatron_lora_actor.py::test_reference_log_probs_are_the_base_models",
        "test_lora_flags.py::test_what_megatron_lora_cannot_do_is_refused",
    ),
    "lora_alpha": (
        "test_fsdp_lora.py::test_lora_steps_equal_peft_with_torch_adamw",
        "test_megatron_lora_actor.py::test_megatron_lora_trains_only_the_adapter_as_fsdp_does",
    ),
    "lora_dropout": ("test_fsdp_lora.py::test_target_modules_exclude_modules_and_dropout_shape_the_adapter",),
    "target_modules": (
        "test_fsdp_lora.py::test_target_modules_exclude_modules_and_dropout_shape_the_adapter",
        "test_lora_flags.py::test_what_megatron_lora_cannot_do_is_refused",
    ),
    "exclude_modules": (
        "test_fsdp_lora.py::test_target_modules_exclude_modules_and_dropout_shape_the_adapter",
        "test_lora_flags.py::test_the_hf_checkpoints_model_kind_is_checked",
    ),
    "lora_adapter_path": (
        "test_fsdp_lora.py::test_checkpoint_holds_the_adapter_and_resumes_it",
        "test_megatron_lora_actor.py::test_megatron_lora_trains_only_the_adapter_as_fsdp_does",
        "test_megatron_lora_actor.py::test_checkpoint_resumes_exactly_and_holds_a_peft_folder",
    ),
    "lora_train_only": ("test_lora_run.py::test_lora_train_only_trains_the_adapter_while_the_engines_keep_the_base",),
    "multi_lora_n_adapters": (
        "test_fsdp_lora.py::test_multi_lora_trains_each_adapter_on_its_own_samples_as_peft_would",
        "test_lora_run.py::test_multi_lora_trains_two_adapters_on_their_own_prompts_and_rewards",
        "test_lora_flags.py::test_what_multi_lora_cannot_do_is_refused",
    ),
    "multi_lora_prompt_data": (
        "test_lora_run.py::test_multi_lora_trains_two_adapters_on_their_own_prompts_and_rewards",
        "test_lora_flags.py::test_multi_lora_data_source_keeps_one_stream_per_adapter_across_a_resume",
    ),
    "multi_lora_rm_path": (
        "test_lora_run.py::test_multi_lora_trains_two_adapters_on_their_own_prompts_and_rewards",
        "test_lora_flags.py::test_what_multi_lora_cannot_do_is_refused",
    ),
    "check_lora_weight_equal": (
        "test_fsdp_lora.py::test_pushes_send_only_the_adapter_which_the_engine_serves",
        "test_megatron_lora_actor.py::test_pushed_adapter_is_what_the_engine_serves",
    ),
    "gradient_checkpointing": (
        "test_fsdp_backend.py::test_gradient_checkpointing_and_offload_round_trip_do_not_change_training",
    ),
    "recompute_activations": (
        "test_flags_behaviour.py::test_megatron_recompute_and_attention_flags_mean_the_same_under_fsdp",
    ),
    "recompute_granularity": (
        "test_flags_behaviour.py::test_megatron_recompute_and_attention_flags_mean_the_same_under_fsdp",
    ),
    "attention_backend": (
        "test_flags_behaviour.py::test_megatron_recompute_and_attention_flags_mean_the_same_under_fsdp",
    ),
    "check_for_nan_in_loss_and_grad": (
        "test_flags_behaviour.py::test_nan_gradient_stops_the_run_unless_the_check_is_off",
    ),
    "custom_megatron_before_train_step_hook_path": (
        "test_train_recipe.py::test_before_train_step_hook_runs_before_every_optimizer_step",
    ),
    "custom_model_provider_path": (
        "test_flag_effects_with_actors.py::test_custom_model_provider_builds_the_megatron_model",
    ),
    "global_batch_size": (
        "test_train_data.py::test_split_round_robin_keeps_each_step_together",
        "test_train_data.py::test_split_rejects_indivisible_batches",
    ),
    "use_dynamic_global_batch_size": (
        "test_train_data.py::test_dynamic_global_batch_size_trains_what_the_rollout_returned_in_one_step",
        "test_upstream_plugins.py::test_train_py_runs_current_upstream_examples_routed_per_sample",
    ),
    "num_steps_per_rollout": ("test_arguments.py::test_inconsistent_batch_sizes_name_flags_and_numbers",),
    "micro_batch_size": ("test_flag_effects_with_actors.py::test_micro_batch_flags_split_each_step",),
    "use_dynamic_batch_size": ("test_flag_effects_with_actors.py::test_micro_batch_flags_split_each_step",),
    "max_tokens_per_gpu": ("test_flag_effects_with_actors.py::test_micro_batch_flags_split_each_step",),
    "balance_data": ("test_train_data.py::test_balance_data_split_uses_token_counts",),
    "calculate_per_token_loss": ("test_fsdp_backend.py::test_per_sample_and_per_token_aggregation",),
    "seed": ("test_flag_effects_with_actors.py::test_seed_seeds_the_trainer",),
    "bf16": ("test_flag_effects.py::test_megatron_precision_and_parallel_flags_reach_the_config",),
    "fp16": ("test_flag_effects.py::test_megatron_precision_and_parallel_flags_reach_the_config",),
    # ---- optimizer and learning-rate schedule -----------------------------------------------------------------
    "optimizer": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "lr": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "adam_beta1": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "adam_beta2": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "adam_eps": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "weight_decay": ("test_flag_effects.py::test_adam_flags_build_the_optimizer",),
    "clip_grad": ("test_flag_effects_with_actors.py::test_clip_grad_bounds_the_update",),
    "min_lr": ("test_flag_effects.py::test_lr_flags_shape_the_schedule",),
    "lr_decay_style": ("test_flag_effects.py::test_lr_flags_shape_the_schedule",),
    "lr_decay_iters": ("test_flag_effects.py::test_lr_flags_shape_the_schedule",),
    "lr_warmup_iters": ("test_flag_effects.py::test_lr_flags_shape_the_schedule",),
    "lr_warmup_fraction": ("test_flag_effects.py::test_lr_flags_shape_the_schedule",),
    # ---- checkpoints ------------------------------------------------------------------------------------------
    "save": ("test_fsdp_checkpoint.py::test_save_then_load_restores_everything",),
    "load": ("test_fsdp_checkpoint.py::test_save_then_load_restores_everything",),
    "ckpt_step": ("test_flags_behaviour.py::test_ckpt_step_loads_that_checkpoint",),
    "save_hf": ("test_fsdp_checkpoint.py::test_save_hf_folder_loads_with_transformers",),
    "no_save_optim": ("test_flag_effects_with_actors.py::test_checkpoint_flags_choose_what_is_saved_and_loaded",),
    "no_load_optim": ("test_flag_effects_with_actors.py::test_checkpoint_flags_choose_what_is_saved_and_loaded",),
    "no_load_rng": ("test_flag_effects_with_actors.py::test_checkpoint_flags_choose_what_is_saved_and_loaded",),
    "finetune": ("test_flag_effects_with_actors.py::test_checkpoint_flags_choose_what_is_saved_and_loaded",),
    "ref_load": ("test_fsdp_checkpoint.py::test_load_hf_folder_and_ref_load",),
    "ref_ckpt_step": ("test_flag_effects_with_actors.py::test_checkpoint_flags_choose_what_is_saved_and_loaded",),
    # ---- model, rollout functions and hooks -------------------------------------------------------------------
    "hf_checkpoint": ("test_data_source.py::test_tokenizer_is_loaded_from_hf_checkpoint_for_chat_template",),
    "trust_remote_code": (
        "test_data_source.py::test_a_tokenizer_that_needs_its_folders_code_runs_it_only_with_trust_remote_code",
        "test_engine_client.py::test_trust_remote_code_reaches_both_engines_command_lines",
    ),
    "model_name": ("test_megatron_convert.py::test_tool_rejects_an_unknown_family",),
    "rollout_function_path": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "custom_generate_function_path": ("test_docs.py::test_generate_snippet_builds_a_masked_multi_turn_sample",),
    "agent_function_path": ("test_trajectory_proxy.py::test_agent_rollout_turn_budget_and_failing_agent",),
    "max_turns": ("test_multi_turn.py::test_context_and_turn_budgets",),
    "rollout_sample_hook_path": (
        "test_flags_behaviour.py::test_default_rollout_runs_sample_hooks_filter_and_all_samples_process",
    ),
    "over_sampling_batch_size": ("test_rollout_manager.py::test_over_sampling_keeps_only_groups_that_pass_the_filter",),
    "dynamic_sampling_filter_path": (
        "test_flags_behaviour.py::test_default_rollout_runs_sample_hooks_filter_and_all_samples_process",
    ),
    "rollout_sample_filter_path": (
        "test_flags_behaviour.py::test_default_rollout_runs_sample_hooks_filter_and_all_samples_process",
    ),
    "rollout_all_samples_process_path": (
        "test_flags_behaviour.py::test_default_rollout_runs_sample_hooks_filter_and_all_samples_process",
    ),
    "partial_rollout": ("test_rollout_manager.py::test_unused_groups_go_back_fresh_or_partial",),
    "mask_offpolicy_in_partial_rollout": (
        "test_fully_async.py::test_aborted_group_goes_back_with_its_partial_response_and_continues_under_new_weights",
    ),
    "rollout_external_engine_addrs": ("test_weight_sync_disk.py::test_external_engine_generates_and_receives_weights",),
    "rollout_engine_start_timeout": (
        "test_flag_effects_with_actors.py::test_rollout_engine_start_timeout_bounds_the_wait",
    ),
    "custom_rollout_log_function_path": (
        "test_flags_behaviour.py::test_custom_log_functions_replace_the_default_figures",
    ),
    "custom_eval_rollout_log_function_path": (
        "test_flags_behaviour.py::test_custom_log_functions_replace_the_default_figures",
    ),
    "rollout_data_postprocess_path": (
        "test_flags_behaviour.py::test_keep_old_actor_takes_old_log_probs_from_the_generating_weights",
    ),
    "custom_convert_samples_to_train_data_path": (
        "test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",
    ),
    "custom_reward_post_process_path": ("test_docs.py::test_rollout_side_hooks_through_the_train_data_conversion",),
    "buffer_filter_path": ("test_data_source.py::test_custom_buffer_filter_is_used",),
    "data_source_path": ("test_docs.py::test_data_source_snippet_saves_and_resumes",),
    # ---- engines and router -----------------------------------------------------------------------------------
    "sglang_server_concurrency": (
        "test_upstream_compat.py::test_generate_state_is_the_rollout_state_with_upstream_names",
    ),
    "sglang_router_ip": ("test_router.py::test_running_router_is_reused_not_launched",),
    "sglang_router_port": ("test_router.py::test_running_router_is_reused_not_launched",),
    "sglang_router_request_timeout_secs": (
        "test_flag_effects_with_actors.py::test_router_request_timeout_reaches_the_router",
    ),
    "use_fault_tolerance": (
        "test_engine_args.py::test_failover_window_covers_one_health_round_with_fault_tolerance_only",
    ),
    "max_restarts": (
        "test_driver_restarts.py::test_restarts_from_save_at_most_max_restarts_times",
        "test_chaos.py::test_random_kills_leave_the_trained_prompts_of_an_uninterrupted_run",
    ),
    "rollout_health_check_interval": (
        "test_engine_args.py::test_failover_window_covers_one_health_round_with_fault_tolerance_only",
    ),
    "rollout_health_check_timeout": (
        "test_engine_args.py::test_failover_window_covers_one_health_round_with_fault_tolerance_only",
    ),
    "rollout_health_check_first_wait": (
        "test_engine_args.py::test_failover_window_covers_one_health_round_with_fault_tolerance_only",
    ),
    # ---- sampling ---------------------------------------------------------------------------------------------
    "rollout_temperature": (
        "test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",
        "test_fsdp_backend.py::test_old_log_probs_equal_plain_forward",
    ),
    "rollout_top_p": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_top_k": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_max_response_len": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_skip_special_tokens": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_stop": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_stop_token_ids": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "rollout_max_context_len": ("test_multi_turn.py::test_context_and_turn_budgets",),
    "rollout_max_prompt_len": ("test_data.py::test_max_prompt_len_drops_long_prompts",),
    # ---- prompt data ------------------------------------------------------------------------------------------
    "prompt_data": ("test_data_source.py::test_groups_have_n_copies_with_running_indices",),
    "input_key": ("test_data.py::test_input_key_and_messages_prompt",),
    "label_key": ("test_data.py::test_missing_label_key_is_an_error",),
    "metadata_key": ("test_flag_effects.py::test_metadata_and_tool_keys_name_the_record_fields",),
    "tool_key": ("test_flag_effects.py::test_metadata_and_tool_keys_name_the_record_fields",),
    "apply_chat_template": ("test_data.py::test_chat_template_matches_tokenizer",),
    "apply_chat_template_kwargs": ("test_data.py::test_tools_and_template_kwargs_reach_the_template",),
    "multimodal_keys": (
        "test_multimodal_data.py::test_every_image_form_is_read_with_its_pixels",
        "test_multimodal_data.py::test_multimodal_flags_are_checked_at_parse_time",
        "test_vlm_run.py::test_train_py_trains_a_vision_language_model",
    ),
    "train_vision_tower": (
        "test_fsdp_vlm.py::test_trained_vision_tower_reaches_the_engine",
        "test_multimodal_data.py::test_multimodal_flags_are_checked_at_parse_time",
    ),
    "rollout_shuffle": ("test_data_source.py::test_epochs_reshuffle_deterministically",),
    "rollout_seed": ("test_data_source.py::test_epochs_reshuffle_deterministically",),
    "rollout_global_dataset": ("test_arguments.py::test_required_inputs_are_named",),
    "num_rollout": ("test_data_source.py::test_compute_num_rollout",),
    "num_epoch": ("test_data_source.py::test_compute_num_rollout",),
    "rollout_batch_size": ("test_data_source.py::test_compute_num_rollout",),
    "n_samples_per_prompt": ("test_data_source.py::test_groups_have_n_copies_with_running_indices",),
    "start_rollout_id": ("test_flag_effects.py::test_start_rollout_id_that_misses_the_data_source_warns",),
    # ---- evaluation -------------------------------------------------------------------------------------------
    "eval_function_path": ("test_flag_effects_with_actors.py::test_eval_function_path_runs_the_evaluation",),
    "eval_prompt_data": ("test_eval_config.py::test_eval_prompt_data_pairs_take_the_eval_flags",),
    "eval_config": ("test_eval_config.py::test_per_dataset_settings_override_defaults_and_flags",),
    "n_samples_per_eval_prompt": ("test_eval_config.py::test_eval_prompt_data_pairs_take_the_eval_flags",),
    "eval_temperature": (
        "test_eval_config.py::test_eval_prompt_data_pairs_take_the_eval_flags",
        "test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",
    ),
    "eval_top_p": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "eval_top_k": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "eval_max_response_len": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "eval_min_new_tokens": ("test_flag_effects.py::test_sampling_flags_are_the_engine_sampling_params",),
    "eval_max_context_len": ("test_engine_args.py::test_context_limit_is_the_requested_length_never_past_the_engine",),
    "eval_max_prompt_len": ("test_flag_effects.py::test_eval_flags_fill_in_each_eval_set",),
    "eval_input_key": ("test_flag_effects.py::test_eval_flags_fill_in_each_eval_set",),
    "eval_label_key": ("test_flag_effects.py::test_eval_flags_fill_in_each_eval_set",),
    "eval_tool_key": ("test_flag_effects.py::test_eval_flags_fill_in_each_eval_set",),
    "eval_reward_key": ("test_flag_effects.py::test_eval_flags_fill_in_each_eval_set",),
    # ---- algorithm: advantages and losses ---------------------------------------------------------------------
    "custom_algorithm_module": ("test_algorithm_registry.py::test_user_estimator_and_policy_loss_train_one_step",),
    "advantage_estimator": ("test_train_data.py::test_baseline_estimator_subtracts_mean_only_and_ppo_keeps_raw",),
    "loss_type": ("test_fsdp_backend.py::test_custom_loss_hook",),
    "custom_loss_function_path": ("test_fsdp_backend.py::test_custom_loss_hook",),
    "custom_advantage_function_path": ("test_docs.py::test_trainer_hooks_through_the_trainer_code",),
    "custom_tis_function_path": ("test_docs.py::test_trainer_hooks_through_the_trainer_code",),
    "eps_clip": ("test_flag_effects.py::test_eps_clip_bounds_the_ratio_from_below",),
    "eps_clip_high": ("test_algorithm_registry.py::test_dual_clip_reports_pg_clipfrac_lower",),
    "eps_clip_c": ("test_algorithm_registry.py::test_dual_clip_reports_pg_clipfrac_lower",),
    "value_clip": ("test_flag_effects.py::test_value_clip_bounds_the_critic_update",),
    "kl_coef": ("test_flag_effects.py::test_kl_coef_takes_the_kl_out_of_the_token_rewards",),
    "use_kl_loss": ("test_flags_behaviour.py::test_ref_update_interval_refreshes_the_reference",),
    "kl_loss_coef": ("test_flag_effects.py::test_kl_and_entropy_flags_change_the_policy_loss",),
    "kl_loss_type": ("test_flag_effects.py::test_kl_and_entropy_flags_change_the_policy_loss",),
    "use_unbiased_kl": ("test_flag_effects.py::test_kl_and_entropy_flags_change_the_policy_loss",),
    "entropy_coef": ("test_flag_effects.py::test_kl_and_entropy_flags_change_the_policy_loss",),
    "loss_agg_mode": ("test_algorithm_registry.py::test_dr_grpo_aggregation_needs_a_response_budget",),
    "gamma": ("test_flag_effects.py::test_gamma_and_lambd_discount_the_ppo_advantages",),
    "lambd": ("test_flag_effects.py::test_gamma_and_lambd_discount_the_ppo_advantages",),
    "num_critic_only_steps": ("test_flag_effects_with_actors.py::test_num_critic_only_steps_holds_the_actor_back",),
    "normalize_advantages": ("test_opd.py::test_the_term_comes_after_the_estimator_and_before_whitening",),
    "disable_grpo_std_normalization": ("test_flag_effects.py::test_grpo_std_normalization_can_be_turned_off",),
    "disable_rewards_normalization": (
        "test_algorithm_registry.py::test_rloo_baseline_is_the_mean_of_the_other_samples",
    ),
    "disable_compute_advantages_and_returns": (
        "test_sft_rollout.py::test_policy_loss_without_advantages_is_refused_at_parse_time",
    ),
    "use_rollout_logprobs": ("test_fsdp_backend.py::test_use_rollout_logprobs_skips_recomputation",),
    "use_tis": ("test_fsdp_backend.py::test_tis_weights_the_policy_loss",),
    "tis_clip": ("test_fsdp_backend.py::test_tis_weights_the_policy_loss",),
    "tis_clip_low": ("test_flag_effects.py::test_tis_clip_low_floors_the_importance_weights",),
    "get_mismatch_metrics": (
        "test_flags_behaviour.py::test_get_mismatch_metrics_measures_the_gap_under_rollout_logprobs",
    ),
    "use_rollout_routing_replay": ("test_routing_replay.py::test_fsdp_training_step_with_replay",),
    "use_opd": ("test_opd.py::test_teacher_log_probs_equal_a_forward_pass_of_the_teacher",),
    "opd_teacher_url": ("test_opd.py::test_teacher_failures_name_the_url_and_the_cause",),
    "opd_kl_coef": ("test_opd.py::test_the_term_comes_after_the_estimator_and_before_whitening",),
    # ---- rewards ----------------------------------------------------------------------------------------------
    "rm_type": ("test_rm_hub.py::test_unknown_rm_type_lists_valid_types",),
    "reward_key": ("test_filter_hub.py::test_nonzero_std_reason_and_reward_key",),
    "group_rm": ("test_rm_hub.py::test_batched_rm_per_sample_and_per_group",),
    "rm_url": ("test_rm_hub.py::test_remote_rm_against_local_server",),
    "rm_request_timeout_secs": ("test_rm_hub.py::test_remote_rm_times_out_and_retries",),
    "rm_max_retries": ("test_rm_hub.py::test_remote_rm_against_local_server",),
    "rm_retry_delay": ("test_rm_hub.py::test_remote_rm_times_out_and_retries",),
    "rm_timeout_secs": ("test_reward_workers.py::test_stuck_answers_time_out_while_the_event_loop_keeps_running",),
    "rm_num_workers": ("test_reward_workers.py::test_stuck_answers_time_out_while_the_event_loop_keeps_running",),
    "custom_rm_path": ("test_rm_hub.py::test_custom_rm_sync_and_async",),
    # ---- logging and trackers ---------------------------------------------------------------------------------
    "use_wandb": ("test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",),
    "wandb_mode": ("test_tracking.py::test_tracker_flags_override_their_environment_variables",),
    "wandb_dir": ("test_tracking.py::test_tracker_flags_override_their_environment_variables",),
    "wandb_key": (
        "test_flag_effects_with_actors.py::test_wandb_host_and_key_are_the_wandb_login",
        "test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",
    ),
    "wandb_host": (
        "test_flag_effects_with_actors.py::test_wandb_host_and_key_are_the_wandb_login",
        "test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",
    ),
    "wandb_team": ("test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",),
    "wandb_group": ("test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",),
    "wandb_project": ("test_tracking.py::test_tracker_flags_override_their_environment_variables",),
    "wandb_run_id": ("test_tracking.py::test_a_resumed_run_continues_its_wandb_run",),
    "disable_wandb_random_suffix": ("test_tracking.py::test_a_resumed_run_continues_its_wandb_run",),
    "wandb_always_use_train_step": ("test_tracking.py::test_a_resumed_run_continues_its_wandb_run",),
    "use_tensorboard": ("test_tracking.py::test_tracker_flags_override_their_environment_variables",),
    "tensorboard_dir": ("test_tracking.py::test_tracker_flags_override_their_environment_variables",),
    "tb_project_name": ("test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",),
    "tb_experiment_name": ("test_tracking.py::test_wandb_offline_and_tensorboard_hold_the_metrics_jsonl_rows",),
    "log_passrate": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "log_reward_category": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "log_correct_samples": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "peak_tflops": (
        "test_flag_effects_with_actors.py::test_peak_tflops_is_the_mfu_denominator",
        "test_flag_effects.py::test_peak_tflops_overrides_the_device_peak",
    ),
    # ---- debug data and CI checks -----------------------------------------------------------------------------
    "debug_rollout_only": ("test_rollout_manager.py::test_rollout_returns_well_formed_train_data",),
    "debug_train_only": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "save_debug_rollout_data": ("test_rollout_manager.py::test_saved_rollout_can_be_read_back",),
    "load_debug_rollout_data": ("test_flags_behaviour.py::test_load_debug_rollout_data_subsample_keeps_whole_batches",),
    "load_debug_rollout_data_subsample": (
        "test_flags_behaviour.py::test_load_debug_rollout_data_subsample_keeps_whole_batches",
    ),
    "save_debug_train_data": ("test_flags_behaviour.py::test_manager_converts_logs_and_saves_train_data",),
    "ci_test": (
        "test_flags_behaviour.py::test_ci_kl_and_logprob_checks",
        "test_ci_test_run.py::test_ci_test_run_fails_when_the_checked_metric_misses",
    ),
    # when the drivers save, evaluate and push (train.py / train_async.py runs)
    "save_interval": ("test_train_e2e.py::test_save_interval_and_eval_interval_pick_their_rollouts",),
    "eval_interval": (
        "test_train_e2e.py::test_save_interval_and_eval_interval_pick_their_rollouts",
        "test_train_e2e.py::test_skip_eval_before_train_leaves_out_the_first_evaluation",
    ),
    "skip_eval_before_train": ("test_train_e2e.py::test_skip_eval_before_train_leaves_out_the_first_evaluation",),
    "update_weights_interval": ("test_train_e2e.py::test_async_run_pushes_weights_every_second_rollout",),
    "ci_disable_kl_checker": ("test_flags_behaviour.py::test_ci_kl_and_logprob_checks",),
    "ci_train_rollout_logprob_abs_diff_threshold": ("test_flag_effects.py::test_ci_logprob_gap_threshold_is_the_flag",),
    "ci_save_grad_norm": ("test_flags_behaviour.py::test_ci_grad_norm_save_and_compare",),
    "ci_load_grad_norm": ("test_flags_behaviour.py::test_ci_grad_norm_save_and_compare",),
    "ci_metric_checker_key": ("test_flags_behaviour.py::test_ci_metric_checker_needs_one_value_at_the_threshold",),
    "ci_metric_checker_threshold": (
        "test_flags_behaviour.py::test_ci_metric_checker_needs_one_value_at_the_threshold",
    ),
    # ---- the command line itself ------------------------------------------------------------------------------
    "custom_config_path": ("test_flags_behaviour.py::test_custom_config_sets_flags_by_dest_or_name",),
}
