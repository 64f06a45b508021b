"""TRL's GRPOConfig options that grpokit's GRPOConfig does not define, and what each means here.

A TRL script or recipe may set any option of TRL 1.16's GRPOConfig (TrainingArguments included). An option
grpokit defines under the same name means the same thing (grpokit/config/fields.py). Every other TRL option is
one of:

- IGNORED: it changes nothing a grpokit run computes or saves, at any value (infrastructure grpokit does its own
  way: it has no DataLoader over prompts, always computes the log-softmax in fp32, ...). Accepted and ignored.
- AT_DEFAULT_ONLY: a feature grpokit does not have. Accepted at TRL's default value (which asks for nothing);
  any other value is refused, with what to use instead.
- IMPLEMENTED: TRL's option, with TRL's meaning, implemented by grpokit outside its own fields (fsdp,
  fsdp_config, ds3_gather_for_generation: FSDP2 sharding, grpokit/config/fsdp.py); a value grpokit cannot run is
  refused, saying why.

Both kinds are GRPOConfig fields all the same (TRL_FIELDS: TRL 1.16's default, and the type HfArgumentParser
parses the option as), so TRL's scripts parse them (`TrlParser`) and read them back
(`training_args.resume_from_checkpoint`) as under TRL. Unknown names (neither grpokit's nor TRL's) are refused
with the nearest valid name. All problems of one config are reported together. tests/test_trl_dropin.py checks
these tables against TRL 1.16's GRPOConfig.
"""

from __future__ import annotations

from typing import Any

_NO_DATALOADER = "grpokit tokenises the prompts once and samples them itself; there is no DataLoader"
_SELF_MANAGED = "grpokit manages this itself"
IGNORED: dict[str, str] = {
    **dict.fromkeys(
        ["dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
         "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
         "remove_unused_columns", "label_names", "length_column_name", "pad_to_multiple_of",
         "group_by_length"], _NO_DATALOADER),
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
    "resume_from_checkpoint": "read by scripts, not by the trainer (as under TRL): TRL's scripts pass it to "
                              "train(resume_from_checkpoint=...); so does grpo train (a path, or true for the newest "
                              "checkpoint in output_dir; --resume is the same as true)",
    "accelerator_config": f"{_NO_DATALOADER}, so accelerate's DataLoader settings (dispatch_batches, split_batches, "
                          "even_batches, ...) have nothing to act on; read back as transformers' AcceleratorConfig",
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
    "parallelism_config": (None, "grpokit runs DDP through accelerate; tensor/context parallelism is not supported"),
    "deepspeed": (None, "DeepSpeed is not installed with grpokit"),  # the advice: config.fsdp.DEEPSPEED_ADVICE
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

# name -> its help text; grpokit.config.fsdp judges the values
IMPLEMENTED: dict[str, str] = {
    "fsdp": "shard the policy and the reference with FSDP2 (docs/distributed.md): true, or TrainingArguments' words "
            "'full_shard' (ZeRO-3), 'shard_grad_op' (ZeRO-2), 'offload', 'auto_wrap', as text or a list",
    "fsdp_config": "FSDP2's settings when fsdp is set: version (2), reshard_after_forward, offload_params (or "
                   "cpu_offload), activation_checkpointing, transformer_layer_cls_to_wrap; a mapping, JSON text or a "
                   "JSON file's path, keys with or without 'fsdp_'",
    "ds3_gather_for_generation": "with fsdp and the local engine: gather the whole policy once per generation call "
                                 "(fast: no gather per token; the full weights exist while it generates); false "
                                 "gathers one layer at a time at every forward (the least memory, much slower)",
}


# Every name of IGNORED, AT_DEFAULT_ONLY and IMPLEMENTED -> (the type HfArgumentParser parses it as, TRL 1.16's
# default). A dict option is `dict | str | None` as in TrainingArguments: on a command line it is JSON text.
_OPTIONAL_INT, _OPTIONAL_STR, _OPTIONAL_BOOL, _DICT_OR_TEXT = int | None, str | None, bool | None, dict | str | None
TRL_FIELDS: dict[str, tuple[Any, Any]] = {
    "dataloader_drop_last": (bool, False), "dataloader_num_workers": (int, 0), "dataloader_pin_memory": (bool, True),
    "dataloader_persistent_workers": (bool, False), "dataloader_prefetch_factor": (_OPTIONAL_INT, None),
    "dataloader_multiprocessing_context": (_OPTIONAL_STR, None), "dataloader_in_order": (bool, True),
    "remove_unused_columns": (_OPTIONAL_BOOL, False), "label_names": (list[str] | None, None),
    "length_column_name": (str, "length"), "ds3_gather_for_generation": (bool, True),
    "pad_to_multiple_of": (int | str | None, "auto"), "group_by_length": (bool, False),
    "log_on_each_node": (bool, True), "logging_nan_inf_filter": (bool, True), "log_level": (str, "passive"),
    "log_level_replica": (str, "warning"), "skip_memory_metrics": (bool, True),
    "include_num_input_tokens_seen": (str | bool, "no"), "log_multimodal": (bool, True),
    "log_unique_prompts": (bool, False), "debug": (str | list[str], ""), "project": (str, "huggingface"),
    "trackio_space_id": (_OPTIONAL_STR, None), "trackio_bucket_id": (_OPTIONAL_STR, None),
    "trackio_static_space_id": (_OPTIONAL_STR, None), "logging_dir": (_OPTIONAL_STR, None),
    "prediction_loss_only": (bool, False), "eval_do_concat_batches": (bool, True),
    "eval_use_gather_object": (bool, False), "eval_accumulation_steps": (_OPTIONAL_INT, None),
    "include_for_metrics": (list[str], []), "batch_eval_metrics": (bool, False),
    "ddp_find_unused_parameters": (_OPTIONAL_BOOL, None), "ddp_bucket_cap_mb": (_OPTIONAL_INT, None),
    "ddp_broadcast_buffers": (_OPTIONAL_BOOL, None), "ddp_static_graph": (_OPTIONAL_BOOL, None),
    "ddp_backend": (_OPTIONAL_STR, None), "ddp_timeout": (int, 1800), "local_rank": (int, -1),
    "save_on_each_node": (bool, False), "enable_jit_checkpoint": (bool, False), "save_safetensors": (bool, True),
    "save_only_model": (bool, False), "restore_callback_states_from_checkpoint": (bool, False),
    "ignore_data_skip": (bool, False), "torch_empty_cache_steps": (_OPTIONAL_INT, None), "use_cache": (bool, False),
    "cache_implementation": (_OPTIONAL_STR, None), "vllm_group_port": (int, 51216),
    "vllm_max_model_length": (_OPTIONAL_INT, None), "average_tokens_across_devices": (bool, True),
    "tf32": (_OPTIONAL_BOOL, None), "full_determinism": (bool, False), "cast_lm_head_to_fp32": (bool, False),
    "do_train": (bool, False), "do_eval": (bool, False), "do_predict": (bool, False),
    "resume_from_checkpoint": (_OPTIONAL_STR, None), "accelerator_config": (_DICT_OR_TEXT, None),
    "optim": (str, "adamw_torch_fused"), "optim_args": (_OPTIONAL_STR, None),
    "optim_target_modules": (list[str] | str | None, None), "label_smoothing_factor": (float, 0.0),
    "fp16": (bool, False), "bf16_full_eval": (bool, False), "fp16_full_eval": (bool, False),
    "torch_compile": (bool, False), "torch_compile_backend": (_OPTIONAL_STR, None),
    "torch_compile_mode": (_OPTIONAL_STR, None), "use_liger_kernel": (bool, False),
    "liger_kernel_config": (_DICT_OR_TEXT, None), "neftune_noise_alpha": (float | None, None),
    "auto_find_batch_size": (bool, False), "logging_strategy": (str, "steps"), "eval_delay": (float, 0),
    "hub_always_push": (bool, False), "data_seed": (_OPTIONAL_INT, None), "train_sampling_strategy": (str, "random"),
    "parallelism_config": (_DICT_OR_TEXT, None), "fsdp": (list[str] | str | None, None),  # bool too (TRL scripts write fsdp: true); forms reads it
    "fsdp_config": (_DICT_OR_TEXT, None),
    "deepspeed": (_DICT_OR_TEXT, None), "router_aux_loss_coef": (float | None, None),
    "vllm_model_impl": (str, "vllm"), "vllm_structured_outputs_regex": (_OPTIONAL_STR, None),
    "vllm_importance_sampling_cap": (float | None, None), "log_completions_hub_repo": (_OPTIONAL_STR, None),
    "use_transformers_continuous_batching": (bool, False),
    "transformers_continuous_batching_config": (_DICT_OR_TEXT, None), "use_transformers_paged": (bool, False),
    "hub_strategy": (str, "every_save"), "hub_token": (_OPTIONAL_STR, None), "hub_revision": (_OPTIONAL_STR, None),
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


def _shown(default: Any) -> str:
    return " or ".join(repr(d) for d in default) if isinstance(default, tuple) else repr(default)


def trl_option_problem(name: str, value: Any) -> str | None:
    """None when a TRL option `name` (not one grpokit defines) can be accepted with `value`, else the message."""
    if name in IGNORED:
        return None
    if name in IMPLEMENTED:
        from grpokit.config.fsdp import fsdp_option_problem  # grpokit.config imports this module

        return fsdp_option_problem(name, value)
    default, advice = AT_DEFAULT_ONLY[name]
    if _is_default(value, default):
        return None
    if name == "deepspeed":
        from grpokit.config.fsdp import DEEPSPEED_ADVICE

        advice = DEEPSPEED_ADVICE
    return (f"{name}={value!r} is a TRL option grpokit does not implement (accepted only at {_shown(default)}): "
            f"{advice}.")


def trl_option_doc(name: str) -> str:
    """The help text of a TRL option grpokit accepts without defining it (`grpo train --help`)."""
    if name in IGNORED:
        return f"TRL option, accepted and ignored: {IGNORED[name]}."
    if name in IMPLEMENTED:
        return f"TRL option: {IMPLEMENTED[name]}."
    default, advice = AT_DEFAULT_ONLY[name]
    return f"TRL option grpokit does not implement, accepted only at {_shown(default)}: {advice}."


def is_trl_option(name: str) -> bool:
    return name in IGNORED or name in AT_DEFAULT_ONLY or name in IMPLEMENTED


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
