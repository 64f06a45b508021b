"""TRL's GRPOConfig options that grpokit's GRPOConfig does not define, and what each means here.

A TRL script or recipe may set any option of TRL 1.16's GRPOConfig (TrainingArguments included). An option
grpokit defines under the same name means the same thing (config.py). Every other TRL option is one of:

- IGNORED: it changes nothing a grpokit run computes or saves, at any value (infrastructure grpokit does its own
  way: it has no DataLoader over prompts, always computes the log-softmax in fp32, ...). Accepted and ignored.
- AT_DEFAULT_ONLY: a feature grpokit does not have. Accepted at TRL's default value (which asks for nothing);
  any other value is refused, with what to use instead.

Unknown names (neither grpokit's nor TRL's) are refused with the nearest valid name. All problems of one config
are reported together. tests/test_trl_compat.py checks this table against TRL 1.16's GRPOConfig.
"""

from __future__ import annotations

from typing import Any

_NO_DATALOADER = "grpokit tokenises the prompts once and samples them itself; there is no DataLoader"
_SELF_MANAGED = "grpokit manages this itself"
IGNORED: dict[str, str] = {
    **dict.fromkeys(
        ["dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
         "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
         "remove_unused_columns", "label_names", "length_column_name", "ds3_gather_for_generation",
         "pad_to_multiple_of", "group_by_length"], _NO_DATALOADER),
    **dict.fromkeys(
        ["log_on_each_node", "logging_nan_inf_filter", "log_level", "log_level_replica", "skip_memory_metrics",
         "include_num_input_tokens_seen", "log_multimodal", "log_unique_prompts", "debug", "project",
         "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "logging_dir"],
        "logging detail: grpokit logs every metric of docs/metrics.md on the main process"),
    **dict.fromkeys(
        ["prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
         "include_for_metrics", "batch_eval_metrics"], "evaluation here samples and scores completions"),
    **dict.fromkeys(
        ["ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
         "ddp_backend", "ddp_timeout", "local_rank", "save_on_each_node", "enable_jit_checkpoint",
         "save_safetensors", "save_only_model", "restore_callback_states_from_checkpoint", "ignore_data_skip",
         "torch_empty_cache_steps", "use_cache", "cache_implementation", "vllm_group_port",
         "vllm_max_model_length", "average_tokens_across_devices", "tf32", "full_determinism"], _SELF_MANAGED),
    "cast_lm_head_to_fp32": "grpokit always computes the log-softmax of the head in fp32",
    "do_train": "a flag for HF example scripts; grpo train always trains",
    "do_eval": "a flag for HF example scripts; evaluation follows eval_strategy and eval_dataset",
    "do_predict": "a flag for HF example scripts",
    "resume_from_checkpoint": "a flag for HF example scripts; use train(resume_from_checkpoint=...) or --resume",
}

_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
# name -> (TRL's default, what to do instead); a tuple default lists several values that all mean the default
AT_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "optim": (_ADAMW, "grpokit's optimizer is torch.optim.AdamW (adam_beta1/2, adam_epsilon, weight_decay)"),
    "optim_args": (None, "grpokit's optimizer is torch.optim.AdamW; set adam_beta1/2, adam_epsilon, weight_decay"),
    "optim_target_modules": (None, "grpokit's optimizer is torch.optim.AdamW over every trainable parameter"),
    "label_smoothing_factor": (0.0, "label smoothing has no meaning for a policy-gradient loss"),
    "fp16": (False, "use bf16=True (fp16 needs loss scaling, which grpokit does not do)"),
    "bf16_full_eval": (False, "evaluation follows bf16"),
    "fp16_full_eval": (False, "use bf16=True"),
    "torch_compile": (False, "not supported yet; the fused head already avoids the (B, T, V) logits"),
    "torch_compile_backend": (None, "torch_compile is not supported yet"),
    "torch_compile_mode": (None, "torch_compile is not supported yet"),
    "use_liger_kernel": (False, "grpokit's fused head already computes log-probs chunk by chunk without "
                                "holding the (B, T, V) logits; leave it False"),
    "liger_kernel_config": (None, "see use_liger_kernel"),
    "neftune_noise_alpha": (None, "NEFTune is for supervised fine-tuning"),
    "auto_find_batch_size": (False, "set per_device_train_batch_size and gradient_accumulation_steps"),
    "logging_strategy": ("steps", "grpokit logs every logging_steps optimizer steps"),
    "eval_delay": (0, "use eval_steps"),
    "hub_always_push": (False, "push_to_hub pushes the final model"),
    "data_seed": (None, "grpokit shuffles the prompts with seed"),
    "train_sampling_strategy": ("random", "use shuffle_dataset: false for the dataset's order"),
    "accelerator_config": (None, "configure accelerate with `accelerate config` / `accelerate launch` flags"),
    "parallelism_config": (None, "grpokit runs DDP through accelerate; tensor/context parallelism is not supported"),
    "fsdp": ((None, "", []), "grpokit runs DDP through accelerate; FSDP is not supported yet"),
    "fsdp_config": (None, "grpokit runs DDP through accelerate; FSDP is not supported yet"),
    "deepspeed": (None, "grpokit runs DDP through accelerate; DeepSpeed is not supported yet"),
    "router_aux_loss_coef": ((None, 0.0), "a Mixture-of-Experts router loss is not added (0 and null, which add none, are accepted)"),
    "vllm_model_impl": ("vllm", "grpokit's vLLM engine uses vLLM's own model implementation"),
    "vllm_structured_outputs_regex": (None, "structured outputs are not supported yet"),
    "vllm_importance_sampling_cap": (None, "use vllm_importance_sampling_clip_max"),
    "log_completions_hub_repo": (None, "completions are written to OUTPUT_DIR/completions.jsonl"),
    "use_transformers_continuous_batching": (False, "use rollout_engine (local or vllm)"),
    "transformers_continuous_batching_config": (None, "use rollout_engine (local or vllm)"),
    "use_transformers_paged": (False, "use rollout_engine (local or vllm)"),
    "hub_strategy": (("every_save", "end", "checkpoint", "all_checkpoints"),
                     "push_to_hub pushes the final model at the end"),
    "hub_token": (None, "log in with `hf auth login` or set HF_TOKEN"),
    "hub_revision": (None, "push_to_hub pushes to the main branch"),
}


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        return any(_is_default(value, d) for d in default)
    if default is None or value is None:
        return value is default
    if isinstance(default, float) or isinstance(value, float):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and isinstance(default, (int, float)) and float(value) == float(default)
    return value == default


def trl_option_problem(name: str, value: Any) -> str | None:
    """None when a TRL option `name` (not a grpokit field) can be accepted with `value`, else the message."""
    if name in IGNORED:
        return None
    default, advice = AT_DEFAULT_ONLY[name]
    if _is_default(value, default):
        return None
    shown = " or ".join(repr(d) for d in default) if isinstance(default, tuple) else repr(default)
    return f"{name}={value!r} is a TRL option grpokit does not implement (accepted only at {shown}): {advice}."


def is_trl_option(name: str) -> bool:
    return name in IGNORED or name in AT_DEFAULT_ONLY


# Keys of TRL's example scripts (ScriptArguments, ModelConfig) that are not GRPOConfig options
_SCRIPT_KEYS = {
    "model_name_or_path": "the model is the YAML key `model:` (grpo train) or GRPOTrainer's first argument",
    "dataset_name": "the dataset is the YAML key `dataset:` (grpo train) or GRPOTrainer(train_dataset=...)",
    "torch_dtype": "set model_init_kwargs: {dtype: bfloat16}",
    "dtype": "set model_init_kwargs: {dtype: bfloat16}",
    "attn_implementation": "set model_init_kwargs: {attn_implementation: sdpa}",
    "model_revision": "set model_init_kwargs: {revision: ...}",
    "use_peft": "pass peft_config=LoraConfig(...) to GRPOTrainer",
    "max_prompt_length_tokens": "use max_prompt_length",
}


def script_key_advice(name: str) -> str | None:
    advice = _SCRIPT_KEYS.get(name)
    return f" It is not a GRPOConfig option: {advice}." if advice else None
