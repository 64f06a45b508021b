"""GRPOTrainer: the loop rollout -> score -> advantages -> update, on accelerate.

One optimizer step, top to bottom (`train`):
  1. if no buffered generation batch is left: `_generate_experience` samples G completions per prompt for this
     process's slice, scores them, gathers rewards so each group is normalised whole (with dynamic sampling,
     more rounds until every kept group has signal), takes old log-probs (only if the batch will be reused or
     the KL goes into the reward) and reference log-probs (only if beta != 0), and computes advantages;
  2. `_optimizer_step` runs gradient_accumulation_steps micro-batches through `policy_loss` (a LossBatch and the
     LossSettings built once from the config), clips the gradient norm, steps AdamW and the schedule, and moves
     the adaptive entropy coefficient;
  3. reference sync, metrics, completions, checkpoints.
All the math lives in grpokit.algorithms; this file only moves tensors between those functions.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from safetensors.torch import load_model, save_model
from accelerate.utils import gather_object, set_seed
from transformers import PreTrainedModel, get_scheduler

from grpokit.algorithms import (
    IS_CORRECTION_MODES,
    KL_ESTIMATORS,
    LossBatch,
    LossSettings,
    entropy_quantile_threshold,
    group_advantages,
    masked_mean,
    mismatch_weights,
    off_policy_mask,
    policy_loss,
)
from grpokit.checkpoint import (
    STATE_FILE,
    CheckpointError,
    damage,
    free_space,
    manifest,
    newest_verified,
    checkpoint_dirs,
    newest_checkpoint,
    publish,
    read_state,
    remove_stale_staging,
    rng_state,
    set_rng_state,
    staging_dir,
    write_json,
)
from grpokit.config import ConfigError, GRPOConfig
from grpokit.callbacks import Callbacks
from grpokit.data import (
    DataError,
    PromptSampler,
    SamplerState,
    check_dataset,
    eval_sets,
    is_conversational,
    render_prompt,
    take_rows,
)
from grpokit.distributed import close_process_group
from grpokit.health import HealthMonitor
from grpokit.hub import try_push
from grpokit.logprob_pass import completion_logprobs
from grpokit.metrics import MetricsWriter, Progress, check_sinks, to_number, trim_jsonl
from grpokit.modeling import (
    ModelError,
    context_length,
    is_peft_model,
    load_policy,
    load_tokenizer,
    load_weights,
    reference_model,
)
from grpokit.algorithms.process import process_advantages
from grpokit.rewards import RewardError, offsets_to_token_indices, resolve_reward_funcs, score_completions, token_char_ends
from grpokit.rewards.registry import per_spec as _per_spec
from grpokit.rollout.engine import EngineContext, Rollout, RolloutRequest, SamplingParams, pad_rollout, resolve_engine
from grpokit.rollout.environments import EnvironmentContractError, Environments
from grpokit.rollout.generate import eos_token_ids, left_pad
from grpokit.rollout.multiturn import Episodes, MultiTurn
from grpokit.tools import Toolbox, resolve_format

logger = logging.getLogger("grpokit")
REFERENCE_FILE = "reference.safetensors"  # the synced reference model's weights in a checkpoint (sync_ref_model)


@dataclass
class TrainerState:
    """Counters passed to reward functions as `trainer_state` and saved in checkpoints."""

    global_step: int = 0
    max_steps: int = 0
    generations: int = 0
    epoch: float = 0.0
    num_input_tokens_seen: int = 0
    nonfinite_skips: int = 0
    consecutive_nonfinite_steps: int = 0
    entropy_coef: float = 0.0  # the entropy bonus's coefficient now (moves with use_adaptive_entropy)
    last_entropy: float = math.inf  # mean entropy of the last step's policy tokens (adaptive control reads it)
    log_history: list[dict[str, float]] = dataclasses.field(default_factory=list)  # every logged row, as TRL's
    interrupted: str | None = None  # the signal that stopped the last train() call ("SIGTERM"), else None
    best_metric: float | None = None  # metric_for_best_model's best value so far
    best_model_checkpoint: str | None = None
    pushed_to: str | None = None  # where push_to_hub published the model (None: not pushed, or the push failed)
    is_world_process_zero: bool = True  # transformers' TrainerState names, which callbacks read
    is_local_process_zero: bool = True


def eval_metric_summary(name: str, values: torch.Tensor, prefix: str = "eval/") -> dict[str, float]:
    """A compute_metrics function's eval results, values (prompts, G) with NaN where it returned None:
    <prefix>metrics/<name>/mean over the scored completions and, when every value is 0 or 1 (a correctness
    check), <prefix>metrics/<name>/pass@G: the fraction of prompts with at least one 1 among their G completions."""
    scored = values[~torch.isnan(values)]
    out = {f"{prefix}metrics/{name}/mean": scored.mean().item() if scored.numel() else math.nan}
    if scored.numel() and bool(((scored == 0) | (scored == 1)).all()):
        out[f"{prefix}metrics/{name}/pass@{values.shape[1]}"] = (values == 1).any(-1).float().mean().item()
    return out


# Metrics whose logged value over several steps is the last one or the largest, not the mean
_LAST_VALUE = {"learning_rate", "num_tokens", "nonfinite_skips", "entropy_coef"}
_LARGEST = {"nonfinite_skipped"}


def window_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """One metrics row for the steps since the last logged one, as TRL logs: each metric's mean over the steps
    where it is a number (NaN: not applicable at that step, left out); counters and the learning rate keep their
    last value; minima (names ending in "/min" or "min_length") the smallest, maxima and nonfinite_skipped the
    largest."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool)]
        if not values:
            continue
        finite = [v for v in values if not math.isnan(v)] or [math.nan]
        if key in _LAST_VALUE:
            out[key] = values[-1]
        elif key.endswith(("/min", "min_length")):
            out[key] = min(finite)
        elif key.endswith(("/max", "max_length")) or key in _LARGEST:
            out[key] = max(finite)
        else:
            out[key] = sum(finite) / len(finite)
    return out


def _tracker_config(args: GRPOConfig) -> dict[str, Any]:
    """The config as trackers store it (tracker objects in report_to by name)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values["report_to"] = [r if isinstance(r, str) else type(r).__name__ for r in args.report_to]
    values["tools"] = [t if isinstance(t, str) else getattr(t, "__name__", repr(t)) for t in args.tools]
    return values


class SaveError(OSError):
    """A model or checkpoint could not be written; the message names the path and the free space there."""


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stayed NaN/inf for max_consecutive_nonfinite_steps optimizer steps in a row."""


@dataclass
class Experience:
    """One generation batch of this process, kept for num_iterations x steps_per_generation micro-batches.

    Tensors have N = per_device_train_batch_size x steps_per_generation rows; prompts are left-padded (N, P),
    completions right-padded (N, T); advantages are (N,), or (N, T) when a reward function scored steps.
    `cursor` counts micro-batches already consumed.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    cursor: int = 0
    sampling_weights: torch.Tensor | None = None  # (N, T) mismatch correction (engines other than local)
    sampling_logp: torch.Tensor | None = None  # (N, T) sampler log-probs (off-policy mask with another engine)


@dataclass
class Generated:
    """One generation batch before advantages: rows (global N prompt rows, G per prompt, in order), this process's
    rollout and decoded texts, every process's rewards (N, F), per function the step rewards of all N completions
    as (token index, reward) lists or None, this process's reward failure counts, the prompt ids its completions
    continued (an environment may have extended them) and its episode_stats."""

    rows: list[int]
    rollout: Rollout
    texts: list[str]
    rewards: torch.Tensor
    steps: list
    failures: list[int]
    prompt_ids: list[list[int]]
    tool_stats: torch.Tensor


def loss_settings(args: GRPOConfig) -> LossSettings:
    """The loss's numbers and names from the config (the KL leaves the loss when it is in the reward)."""
    objective, aggregation = args.resolved_loss
    return LossSettings(
        policy_objective=objective, loss_aggregation=aggregation,
        importance_sampling_level=args.importance_sampling_level, epsilon_low=args.epsilon_low,
        epsilon_high=args.resolved_epsilon_high, delta=args.delta, beta=0.0 if args.kl_in_reward else args.beta,
        kl_estimator=args.kl_estimator, use_bias_correction_kl=args.use_bias_correction_kl,
        off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_coef=args.entropy_coef,
        max_completion_length=args.max_completion_length, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
        sampling_weights_per_sequence=IS_CORRECTION_MODES[args.vllm_importance_sampling_mode][0],
        extra=dict(args.loss_kwargs),
    )


class GRPOTrainer:
    """TRL's GRPOTrainer interface (same arguments, same reward-function contract) over grpokit's loop.

    model: a path or hub name, a PreTrainedModel, or a PeftModel (its adapter trains; the reference is the base
    model with the adapter switched off). reward_funcs: one or a list of reward functions, built-in names, import
    paths, reward-service URLs, or reward models (paths, names or AutoModelForSequenceClassification objects);
    None or [] is refused, as TRL does without an environment. train_dataset: a Dataset or, with max_steps, an
    IterableDataset (see grpokit.data.take_rows). eval_dataset: a Dataset, an IterableDataset, or several
    named ones (a DatasetDict or a dict), each evaluated and logged as eval/<name>/... processing_class: the
    policy's tokenizer (default: the one saved beside the model). reward_processing_classes: a tokenizer per
    reward function, used by reward models. callbacks: transformers TrainerCallback objects, called at the
    events grpokit/callbacks.py lists with this trainer's args and state; control.should_training_stop /
    should_save / should_evaluate are honoured.
    optimizers: (optimizer, lr_scheduler) to use instead of AdamW and the configured schedule (either may be
    None). peft_config: wrap the model with this PEFT adapter. compute_metrics: functions with the reward
    contract scored on eval completions only (eval/metrics/<name>/mean, and pass@G for 0/1 values).
    tools: functions the model may call (type hints and a docstring; or TOOLS names / import paths), added to
    the config's `tools`. environment_factory: a callable returning an environment, or {name: callable} chosen by
    each row's `environment` column (grpokit/rollout/environments.py). Either one makes every rollout a
    multi-turn episode (grpokit/rollout/multiturn.py, docs/tools.md).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        compute_metrics: Any = None,
    ) -> None:
        self.args = args = args or GRPOConfig()
        _refuse_unsupported(quantization_config=quantization_config, rollout_func=rollout_func)
        self.callbacks = Callbacks(callbacks, self)  # checked now; called from on_init_end, at the end
        # Without CUDA, accelerate forms a (gloo) process group only when told to run on the CPU.
        multi_process_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.accelerator = Accelerator(cpu=multi_process_cpu or args.use_cpu)
        args.check_geometry(self.accelerator.num_processes)
        if self.accelerator.num_processes > 1:
            atexit.register(close_process_group)  # drained before destroyed: no gloo deadlock at exit
        check_sinks(args.report_to)
        _check_output_dir(args.output_dir)
        self.spg = args.resolved_steps_per_generation(self.accelerator.num_processes)
        self.reuses_batch = args.num_iterations > 1 or self.spg > args.gradient_accumulation_steps
        self.steps_per_generation_batch = self.spg * args.num_iterations // args.gradient_accumulation_steps
        if environment_factory is not None and args.environment_factory is not None:
            raise ConfigError("environment_factory is given both to GRPOTrainer and in the config; give it once.")
        if args.environment_factory is not None:
            environment_factory = _import_path(args.environment_factory, "environment_factory")
        train_dataset = self._train_rows(train_dataset, environment_factory)
        self.eval_datasets = _eval_rows(eval_dataset)
        self._setup_agent(tools, environment_factory, train_dataset)
        self._resolve_rewards(reward_funcs, reward_processing_classes, compute_metrics)
        if (args.eval_strategy != "no" or args.eval_on_start or compute_metrics is not None) and not self.eval_datasets:
            raise ConfigError(
                "eval_strategy, eval_on_start and compute_metrics need an eval_dataset; pass eval_dataset=... to "
                "GRPOTrainer (or eval_dataset: in the YAML)."
            )
        if is_peft_model(model) and peft_config is not None:
            raise ConfigError(
                "model is already a PeftModel and peft_config is given too: pass the PeftModel alone (its adapter "
                "trains), or the base model with peft_config."
            )

        set_seed(args.seed)
        init_kwargs = dict(args.model_init_kwargs)
        if args.trust_remote_code:
            init_kwargs.setdefault("trust_remote_code", True)
        self.tokenizer = self.processing_class = load_tokenizer(model, processing_class, args.trust_remote_code)
        self.multiturn = self._multiturn(train_dataset)  # checks the chat template before any model loads
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.prompt_ids = self._tokenize_prompts(train_dataset)
        self.eval_prompt_ids = {
            name: self._tokenize_prompts(ds, f" of {_eval_label(name)}") for name, ds in self.eval_datasets.items()
        }
        all_prompts = self.prompt_ids + [p for ids in self.eval_prompt_ids.values() for p in ids]
        _check_context(context_length(model, init_kwargs), all_prompts, args)  # config only: cheap
        policy = self._load_policy(model, init_kwargs, peft_config)
        self.state = TrainerState(max_steps=self._total_steps(), entropy_coef=args.entropy_coef,
                                  is_world_process_zero=self.accelerator.is_main_process,
                                  is_local_process_zero=self.accelerator.is_local_main_process)
        self.loss_settings = loss_settings(args)
        # grpokit does not add a Mixture-of-Experts router's load-balancing loss (TRL 1.16 does, with
        # router_aux_loss_coef); the name is TRL's, so a script that reads it sees the truth.
        self.aux_loss_enabled = False
        _warn_sequence_level_token_sum(args)
        optimizer, scheduler = optimizers if optimizers is not None else (None, None)
        if optimizer is None:
            optimizer = torch.optim.AdamW(
                [p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay,
            )
        if scheduler is None:
            warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.state.max_steps)
            scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup, self.state.max_steps,
                                      scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs))
        self.scheduler = scheduler
        self.model, self.optimizer = self.accelerator.prepare(policy, optimizer)
        self.sampler = PromptSampler(len(train_dataset), args.seed, args.shuffle_dataset)
        self.sampling = SamplingParams(
            args.max_completion_length, args.temperature, args.top_p, args.top_k, args.min_p,
            args.repetition_penalty, args.generation_kwargs,
        )
        self.experience: Experience | None = None
        self._last_eval_step: int | None = None
        self._recent_completions: list[dict[str, Any]] = []
        self._last_generation_metrics: dict[str, float] = {}
        self._reward_logs = RewardLogs()
        self._stop_signal: int | None = None
        self.engine_name = "vllm" if args.use_vllm else args.rollout_engine
        # The sampler's log-probs are compared with the trainer's only where another program samples.
        self.correct_mismatch = args.vllm_importance_sampling_correction and self.engine_name != "local"
        off_policy_mask_reads_sampler = args.off_policy_mask_threshold is not None and self.engine_name != "local"
        self.wants_sampler_logprobs = self.correct_mismatch or off_policy_mask_reads_sampler
        self.engine = self._make_engine(all_prompts)
        self._weights_version = 0  # bumped by every optimizer step that changed the weights, and by a resume
        self._engine_version: int | None = getattr(self.engine, "version", 0)
        self.callbacks.event("on_init_end")

    # ------------------------------------------------------------------ setup helpers
    def _train_rows(self, train_dataset, environment_factory=None):
        """train_dataset, checked; a streaming one read up to the rows max_steps consumes (needs max_steps). With
        an environment_factory the environment may own the data (TRL): no dataset, or no 'prompt' column, and
        reset() supplies the prompt, appended to an empty user message."""
        args = self.args
        self._placeholder_prompts = False
        if train_dataset is None and environment_factory is not None:
            train_dataset = self._placeholder_rows(environment_factory)
        if train_dataset is None:
            raise ConfigError("`train_dataset` is required: a datasets.Dataset (or IterableDataset) with a 'prompt' "
                              "column, e.g. Dataset.from_list([{'prompt': ...}, ...]), unless an "
                              "environment_factory owns the data.")
        if (environment_factory is not None and isinstance(train_dataset, datasets.Dataset)
                and "prompt" not in train_dataset.column_names):
            self._placeholder_prompts = True
            train_dataset = train_dataset.add_column("prompt", [[{"role": "user", "content": ""}]] * len(train_dataset))
        if isinstance(train_dataset, datasets.IterableDataset):
            if args.max_steps <= 0:
                raise ConfigError(
                    "train_dataset is an IterableDataset (streaming), which has no length to count epochs by: set "
                    "max_steps (e.g. max_steps=1000) instead of num_train_epochs."
                )
            prompts = args.global_generation_batch_size(self.accelerator.num_processes) // args.num_generations
            generations = math.ceil(args.max_steps / self.steps_per_generation_batch)
            train_dataset = take_rows(train_dataset, prompts * generations)
        check_dataset(train_dataset)
        return train_dataset

    def _setup_agent(self, tools, environment_factory, train_dataset) -> None:
        """The toolbox (tools= plus the config's `tools`) and the environments; both checked before anything loads."""
        args = self.args
        specs = ([tools] if callable(tools) or isinstance(tools, str) else list(tools or [])) + list(args.tools)
        try:
            self.toolbox = Toolbox(specs, timeout=args.tool_timeout)
            self.tool_call_format = resolve_format(args.tool_call_format)
            self.environments = Environments(environment_factory) if environment_factory is not None else None
            self._environment_schemas = {}  # per environment name: the schemas of its methods (its tools)
            if self.environments is not None:
                for dataset in [train_dataset, *self.eval_datasets.values()]:
                    self.environments.check_rows(dataset)
                for name, methods in self.environments.tools.items():
                    self._environment_schemas[name] = Toolbox([]).with_methods(methods).schemas
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from exc
        self.agentic = bool(specs) or self.environments is not None

    def _multiturn(self, train_dataset) -> MultiTurn | None:
        """The episode loop, when there are tools or environments; conversational prompts get the tool schemas in
        their chat template (each environment's own methods added for its rows)."""
        if not self.agentic:
            return None
        conversational = is_conversational(train_dataset[0]["prompt"])
        try:
            first_environment = next(iter(self._environment_schemas), None)
            with_tools = bool(self.toolbox.schemas) or any(self._environment_schemas.values())
            return MultiTurn(self.tokenizer, self.toolbox, self.tool_call_format,
                             [self.tokenizer.eos_token_id], conversational,
                             self.args.max_tool_calling_iterations, self._template_kwargs(first_environment),
                             with_tools)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def _template_kwargs(self, environment: str | None = None) -> dict[str, Any]:
        """chat_template_kwargs, plus the tool schemas the model may call (those of the row's environment too)."""
        kwargs = dict(self.args.chat_template_kwargs or {})
        schemas = self.toolbox.schemas + self._environment_schemas.get(environment, []) if self.agentic else []
        if schemas:
            kwargs["tools"] = schemas
        return kwargs

    def _placeholder_rows(self, environment_factory) -> datasets.Dataset:
        """No train_dataset: one generation batch of empty chat prompts, which reset() fills; max_steps sets the
        length (TRL's rule)."""
        args = self.args
        if isinstance(environment_factory, dict):
            raise ConfigError("A dict environment_factory (several environments) requires a `train_dataset` with an "
                              "'environment' column to route each row to its environment; give a dataset, or a single "
                              "factory.")
        if args.max_steps <= 0:
            raise ConfigError("Without a train_dataset (the environment owns the data and reset() returns the prompt), "
                              "max_steps must be set to a positive number: it is the training length.")
        self._placeholder_prompts = True
        rows = args.global_generation_batch_size(self.accelerator.num_processes) // args.num_generations
        return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})

    def _resolve_rewards(self, reward_funcs, reward_processing_classes, compute_metrics) -> None:
        """The reward functions, their weights and names, the tokenizer of each reward model
        (reward_processing_classes, None where the function loads its own or needs none), and the compute_metrics
        functions."""
        args = self.args
        reward_model_kwargs = {"device": str(self.accelerator.device), **args.reward_model_kwargs}
        specs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        environment_rewards = self.environments.reward_functions() if self.environments is not None else []
        if not specs and not environment_rewards:
            raise ConfigError(
                "No reward source provided: pass reward_funcs (a function, a list of them, built-in names, import "
                "paths or reward models), or an environment_factory whose environments define get_reward(); "
                "without one every advantage would be 0 and nothing would be learned."
            )
        self.reward_processing_classes = _per_spec(reward_processing_classes, len(specs))
        self.reward_funcs = resolve_reward_funcs(
            list(specs), reward_model_kwargs, max_completion_length=args.max_completion_length,
            processing_classes=self.reward_processing_classes,
        ) if specs else []  # an environment's get_reward may be the only reward (added below)
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ConfigError(
                f"reward_weights has {len(weights)} entries but there are {len(self.reward_funcs)} reward functions; "
                "give one weight per function, in order."
            )
        if environment_rewards:  # each environment class with get_reward: one more function, weight 1 (TRL)
            self.reward_funcs += resolve_reward_funcs(environment_rewards, reward_model_kwargs)
            weights = list(weights) + [1.0] * len(environment_rewards)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.reward_names = [f.name for f in self.reward_funcs]
        self.metric_funcs = []
        if compute_metrics is not None:  # reward-contract functions scored on eval completions only
            metric_specs = compute_metrics if isinstance(compute_metrics, (list, tuple)) else [compute_metrics]
            self.metric_funcs = resolve_reward_funcs(list(metric_specs), reward_model_kwargs,
                                                     max_completion_length=args.max_completion_length)

    def _load_policy(self, model, init_kwargs: dict[str, Any], peft_config):
        """The policy (with its PEFT adapter, if any), the reference model (only when beta != 0 and there is no
        adapter to switch off), dropout and gradient checkpointing set as configured."""
        args = self.args
        policy = load_policy(model, init_kwargs)
        if peft_config is not None:
            from peft import get_peft_model

            policy = get_peft_model(policy, peft_config)
        self.uses_peft = is_peft_model(policy)
        if args.sync_ref_model and self.uses_peft:
            raise ConfigError(
                "sync_ref_model=True with a PEFT adapter: the reference is the base model with the adapter switched "
                "off, so there is no separate reference to sync. Set sync_ref_model=False or train without PEFT."
            )
        self.ref_model = None
        if args.beta != 0.0 and not self.uses_peft:
            self.ref_model = reference_model(policy, model, init_kwargs).to(self.accelerator.device)
        if args.disable_dropout:
            for module in [policy] + ([self.ref_model] if self.ref_model is not None else []):
                _disable_dropout(module)
        if args.gradient_checkpointing:
            kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if self.uses_peft:
                policy.enable_input_require_grads()
        policy.config.use_cache = False
        return policy

    def _tokenize_prompts(self, dataset, where: str = "") -> list[list[int]]:
        """Token ids of every prompt, checked before any model loads; `where` names the dataset in errors."""
        environments = self._environment_names(dataset)
        try:
            texts = [render_prompt(self.tokenizer, p, self._template_kwargs(e))
                     for p, e in zip(dataset["prompt"], environments)]
        except DataError:
            raise
        except Exception as exc:  # a chat template that fails on these prompts (or on tools=...)
            raise ConfigError(f"The chat template failed to render the prompts{where}: {type(exc).__name__}: "
                              f"{exc}") from exc
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        limit = self.args.max_prompt_length
        for row, seq in enumerate(ids):
            if not seq:
                raise ConfigError(f"Prompt at row {row}{where} is empty after tokenisation; remove it from the dataset.")
            if limit is not None and len(seq) > limit:
                raise ConfigError(
                    f"Prompt at row {row}{where} has {len(seq)} tokens, more than max_prompt_length={limit}; raise "
                    "max_prompt_length or filter long prompts (e.g. dataset.filter(...))."
                )
        return ids

    def _environment_names(self, dataset) -> list[str | None]:
        """Each row's environment name (a dict environment_factory), else None."""
        if self.environments is None or not self.environments.named:
            return [None] * len(dataset)
        return self.environments.resolve_names(dataset["environment"])

    def _make_engine(self, prompts: list[list[int]]):
        """The rollout engine named by rollout_engine / use_vllm, built from the live (unwrapped) policy."""
        args = self.args
        try:
            factory = resolve_engine(self.engine_name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.eos_ids = eos_token_ids(self.unwrapped, self.tokenizer)
        longest = max(map(len, prompts))
        if self.environments is not None and args.max_prompt_length:  # reset() may lengthen prompts up to this
            longest = max(longest, args.max_prompt_length)
        self.max_model_length = longest + args.max_completion_length
        context = EngineContext(
            model=self.unwrapped, tokenizer=self.tokenizer, eos_token_ids=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id, max_model_length=self.max_model_length,
            options=args, autocast=self._autocast,
            extra={"max_concurrent_sequences": args.per_device_train_batch_size * self.spg},
        )
        engine = factory(context)
        atexit.register(engine.close)
        return engine

    def _rollout(self, prompt_ids: list[list[int]], sample_ids: torch.Tensor, return_logprobs: bool = False,
                 params: SamplingParams | None = None) -> Rollout:
        """Completions from the engine, after pushing the weights to it if they changed since its last sync."""
        if self._engine_version != self._weights_version:
            shared = getattr(self.engine, "shared_across_processes", False)  # one server for every process
            if not shared or self.accelerator.is_main_process:
                self.engine.sync_weights(self.unwrapped, self._weights_version)
            if shared:
                self.accelerator.wait_for_everyone()
            self._engine_version = self._weights_version
        request = RolloutRequest(prompt_ids, sample_ids, params or self.sampling, self.args.seed, return_logprobs)
        return self.engine.generate(request)

    def _episodes(self, dataset, rows: list[int], prompt_ids: list[list[int]], sample_ids: torch.Tensor,
                  return_logprobs: bool = False) -> Episodes:
        """Completions of these dataset rows: one engine call, or multi-turn episodes with tools / environments."""
        if self.multiturn is None:
            rollout = self._rollout(prompt_ids, sample_ids, return_logprobs)
            texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            chat = is_conversational(dataset[rows[0]]["prompt"]) if rows else False
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
            ones = [1] * len(rows)
            return Episodes(rollout, prompt_ids, completions, texts, [0] * len(rows), [0] * len(rows), ones)
        environments = None
        if self.environments is not None:
            columns = dataset[rows]
            row_dicts = [{k: v[i] for k, v in columns.items()} for i in range(len(rows))]
            placeholder = self._placeholder_prompts and dataset is self.train_dataset
            environments, observations = self.environments.reset(
                [{k: v for k, v in row.items() if k != "prompt"} for row in row_dicts] if placeholder else row_dicts)
            prompts = [row["prompt"] if obs is None else _with_observation(row["prompt"], obs)
                       for row, obs in zip(row_dicts, observations)]
            prompt_ids = [ids if obs is None else self._tokenize_extended(prompt, row)
                          for ids, prompt, row, obs in zip(prompt_ids, prompts, row_dicts, observations)]

        def generate(ids, sample_ids, params):
            return self._rollout(ids, sample_ids, return_logprobs, params)

        episodes = self.multiturn.run(generate, prompt_ids, sample_ids, self.sampling, environments, return_logprobs)
        if environments is not None:
            episodes.environments, episodes.prompts = environments, prompts
        return episodes

    def _tokenize_extended(self, prompt: Any, row: dict[str, Any]) -> list[int]:
        """A prompt that reset() extended, tokenised and checked against max_prompt_length and the engine's
        context (the engine was sized for the dataset's prompts)."""
        text = render_prompt(self.tokenizer, prompt, self._template_kwargs(row.get("environment")))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        limit = self.args.max_prompt_length or self.max_model_length - self.args.max_completion_length
        if len(ids) > limit:
            raise EnvironmentContractError(
                f"reset() made a prompt {len(ids)} tokens long, more than "
                f"{'max_prompt_length' if self.args.max_prompt_length else 'the longest dataset prompt, which sized the engine'}"
                f" ({limit}); set max_prompt_length to the longest prompt reset() can make, or return shorter text."
            )
        return ids

    def _total_steps(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        global_batch = self.args.global_generation_batch_size(self.accelerator.num_processes)
        prompts_per_generation = global_batch // self.args.num_generations
        generations = math.ceil(self.args.num_train_epochs * len(self.train_dataset) / prompts_per_generation)
        return max(1, generations * self.steps_per_generation_batch)

    @property
    def unwrapped(self) -> PreTrainedModel:
        return self.accelerator.unwrap_model(self.model)

    def _autocast(self):
        if not self.args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainerState:
        """Train to max_steps (or resume and continue to this run's max_steps). Returns the state; a run stopped
        by SIGTERM/SIGINT returns after saving a checkpoint, with state.interrupted set to the signal's name.
        A finished run's last log_history row carries TRL's summary (train_loss, train_runtime, ...): added to the
        final step's row, as TRL does, or as a row of its own when an evaluation row came after it."""
        args, acc = self.args, self.accelerator
        checkpoint = self._resolve_resume(resume_from_checkpoint)
        if checkpoint is not None:
            self._load_checkpoint(checkpoint)
        self.state.interrupted = None
        writer = None
        if acc.is_main_process:
            self.health = self._health_monitor()
            writer = MetricsWriter(args.output_dir, args.report_to, _tracker_config(args))
        progress = Progress(self.state.max_steps, self.state.global_step, args.disable_tqdm) if acc.is_main_process else None
        previous_handlers = self._install_signal_handlers()
        started, first_step, losses = time.perf_counter(), self.state.global_step, []
        try:
            self.callbacks.event("on_train_begin")
            self.callbacks.event("on_epoch_begin")
            if args.eval_on_start and self.state.global_step == 0 and self.eval_datasets:
                self._evaluate(writer)
            window: list[dict[str, float]] = []
            progress_at = self.state.global_step
            while self.state.global_step < self.state.max_steps:
                epochs_before = math.floor(self.state.epoch)
                self.callbacks.event("on_step_begin")
                window.append(self._train_step(writer))
                losses.append(window[-1].get("loss", math.nan))
                step = self.state.global_step
                logged = self._log(writer, window) if self._log_due(step) else None
                if progress is not None and (progress.bar is not None or logged is not None):
                    progress.update(logged or window[-1] | {"step": step}, step - progress_at)  # the bar every step
                    progress_at = step
                if logged is not None:
                    window = []
                epoch_ended = math.floor(self.state.epoch) > epochs_before
                if epoch_ended:
                    self.callbacks.event("on_epoch_end")
                control = self.callbacks.event("on_step_end")
                asked_eval, asked_save = self.callbacks.take("should_evaluate"), self.callbacks.take("should_save")
                if self.eval_datasets and (self._eval_due(step, epoch_ended) or asked_eval):
                    self._evaluate(writer)
                stop = self._stop_requested()
                if stop or asked_save or self._save_due(step, epoch_ended):
                    self.save_checkpoint()
                if stop:
                    name = signal.Signals(self._stop_signal).name
                    self.state.interrupted = name
                    logger.warning("Stopped by signal %s after step %d; checkpoint saved.", self._stop_signal, step)
                    return self.state
                if control.should_training_stop:
                    logger.info("A callback stopped training after step %d.", step)
                    break
                if epoch_ended:
                    self.callbacks.event("on_epoch_begin")
            if self.eval_datasets and self._last_eval_step != self.state.global_step:
                self._evaluate(writer)
            if args.load_best_model_at_end and self.state.best_model_checkpoint:
                load_weights(self.unwrapped, Path(self.state.best_model_checkpoint))
            self.save_model(args.output_dir)
            if args.push_to_hub and acc.is_main_process:
                self.state.pushed_to = try_push(args.output_dir, args.hub_model_id, args.hub_private_repo)
            summary = self._summary_row(time.perf_counter() - started, first_step, losses)
            last = self.state.log_history[-1] if self.state.log_history else {}
            if last.get("step") == self.state.global_step and "loss" in last:  # TRL: the last window's row
                last.update(summary)
            else:
                self.state.log_history.append(summary)
            self.callbacks.event("on_train_end")
        finally:
            self._restore_signal_handlers(previous_handlers)
            if writer is not None:
                writer.close()
                progress.close()
        return self.state

    def _summary_row(self, seconds: float, first_step: int, losses: list[float]) -> dict[str, float]:
        """TRL's last log_history row: train_loss (the mean loss of this call's steps), train_runtime (s),
        train_samples_per_second and train_steps_per_second (completions and optimizer steps per second)."""
        steps = self.state.global_step - first_step
        finite = [v for v in losses if not math.isnan(v)]
        samples = steps * self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * \
            self.accelerator.num_processes
        return {
            "step": self.state.global_step, "epoch": self.state.epoch,
            "train_loss": sum(finite) / len(finite) if finite else math.nan,
            "train_runtime": seconds,
            "train_samples_per_second": samples / max(seconds, 1e-9),
            "train_steps_per_second": steps / max(seconds, 1e-9),
        }

    def _train_step(self, writer: MetricsWriter | None) -> dict[str, float]:
        """One optimizer step (generating a batch first when none is left); its metrics as numbers."""
        args, started = self.args, time.perf_counter()
        if self.experience is None:
            self.experience = self._generate_experience(writer)
            if math.isnan(self._last_generation_metrics.get("reward", 0.0)):
                first = self.train_dataset[self._first_row] if self._first_row is not None else {}
                logger.warning(
                    "All reward functions returned None for the following kwargs: %s (and every other completion of "
                    "the generation batch for step %d): every advantage is 0, so only the KL term (if beta > 0) "
                    "moves the policy. Check that the reward functions apply to these prompts.",
                    first, self.state.global_step + 1,
                )
        step_metrics = self._optimizer_step(self.experience)
        if self.experience.cursor >= self.spg * args.num_iterations:
            self.experience = None
        self.state.global_step += 1
        self.state.epoch = self.sampler.epoch_progress
        if args.sync_ref_model and self.state.global_step % args.ref_model_sync_steps == 0:
            self._sync_reference()
        step_metrics["step_seconds"] = time.perf_counter() - started
        step_metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
        return {k: to_number(v) for k, v in {**self._last_generation_metrics, **step_metrics}.items()}

    def _log_due(self, step: int) -> bool:
        args = self.args
        return step % args.logging_steps == 0 or step == self.state.max_steps or (args.logging_first_step and step == 1)

    def _eval_due(self, step: int, epoch_ended: bool) -> bool:
        strategy = self.args.eval_strategy
        if strategy == "steps":
            return step % (self.args.eval_steps or self.args.logging_steps) == 0
        return strategy == "epoch" and epoch_ended

    def _save_due(self, step: int, epoch_ended: bool) -> bool:
        strategy = self.args.save_strategy
        return (strategy == "steps" and step % self.args.save_steps == 0) or (strategy == "epoch" and epoch_ended)

    def _log(self, writer: MetricsWriter | None, window: list[dict[str, float]]) -> dict[str, float]:
        """The metrics row of the steps since the last one (their mean; see window_mean), on every process."""
        row = {"step": self.state.global_step, "epoch": self.state.epoch, **window_mean(window)}
        self.state.log_history.append(row)
        self.callbacks.event("on_log", logs=row)
        if writer is not None:
            self._watch(writer.log(row))
            if self.args.num_completions_to_print:
                self._print_completions()
        return row

    # ------------------------------------------------------------------ 1. generation -> experience
    def _generate_experience(self, writer: MetricsWriter | None) -> Experience:
        args, acc = self.args, self.accelerator
        started = time.perf_counter()
        self._reward_logs.drain()  # anything logged while scoring eval completions is not this batch's
        gen = self._sample_round()
        sampling_metrics: dict[str, float] = {}
        if args.dynamic_sampling:
            gen, sampling_metrics = self._dynamic_sampling(gen)
        generation_seconds = time.perf_counter() - started
        local = len(gen.rows) // acc.num_processes
        first = acc.process_index * local
        mine, rollout = gen.rows[first : first + local], gen.rollout
        self._first_row = mine[0] if mine else None  # named by the warning when no reward applies

        prompt_ids, prompt_mask = left_pad(gen.prompt_ids, self.tokenizer.pad_token_id)
        loss_mask = rollout.model_mask.clone()  # tool / environment tokens are context, never in the loss
        if args.mask_truncated_completions:
            loss_mask[rollout.truncated] = 0
        experience = Experience(
            prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask, loss_mask,
            advantages=torch.zeros(local), old_logp=None, ref_logp=None,
        )
        mismatch = {}
        if self.reuses_batch or self.correct_mismatch or args.kl_in_reward:
            trainer_logp = self._batched_logprobs(self.model, experience)
            experience.old_logp = trainer_logp if self.reuses_batch else None  # fresh batch: pi_old = pi_theta
            if self.correct_mismatch:
                experience.sampling_weights, mismatch = mismatch_weights(
                    trainer_logp, rollout.logprobs, rollout.model_mask.float(),
                    args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
                    args.vllm_importance_sampling_clip_max,
                )
        if args.off_policy_mask_threshold is not None and rollout.logprobs is not None:
            experience.sampling_logp = rollout.logprobs
        if self.ref_model is not None:
            experience.ref_logp = self._batched_logprobs(self.ref_model, experience)
        elif args.beta != 0.0:  # PEFT: the reference is the base model with the adapter switched off
            with self.unwrapped.disable_adapter():
                experience.ref_logp = self._batched_logprobs(self.model, experience)

        rewards, weights, names = gen.rewards, self.reward_weights, self.reward_names
        if args.kl_in_reward:  # one more reward term: -beta x the completion's summed KL, where anything scored
            rewards, weights, names = self._with_kl_penalty(gen.rewards, trainer_logp, experience)
        advantages, reward_stats = self._advantages(rewards, gen.steps, weights)
        my_advantages = advantages[first : first + local]
        if my_advantages.dim() == 2:
            my_advantages = my_advantages[:, : rollout.completion_ids.shape[1]].contiguous()
        experience.advantages = my_advantages

        self._last_generation_metrics = self._generation_metrics(
            rollout, reward_stats, gen.failures, generation_seconds, names
        )
        if self.agentic:
            self._last_generation_metrics.update(self._tool_metrics(gen.tool_stats))
        self._last_generation_metrics.update(self._reduce_extremes(mismatch))
        self._last_generation_metrics.update(sampling_metrics)
        extra, logged_metrics = self._reward_logs.drain()
        self._last_generation_metrics.update(self._reward_metrics(logged_metrics))
        self._log_completions(writer, mine, gen.texts, gen.rewards[first : first + local], my_advantages, extra)
        return experience

    def _sample_round(self) -> "Generated":
        """Prompts for one generation batch, their completions (this process's slice) and every process's scores."""
        args, acc = self.args, self.accelerator
        global_batch = args.global_generation_batch_size(acc.num_processes)
        prompt_rows = self.sampler.take(global_batch // args.num_generations)
        rows = [r for r in prompt_rows for _ in range(args.num_generations)]  # each prompt G times, all ranks
        local = global_batch // acc.num_processes
        first = acc.process_index * local
        mine = rows[first : first + local]
        sample_ids = torch.arange(first, first + local) + self.state.generations * global_batch
        episodes = self._episodes(self.train_dataset, mine, [self.prompt_ids[r] for r in mine], sample_ids,
                                  return_logprobs=self.wants_sampler_logprobs)
        self.state.generations += 1
        local_rewards, failures, local_steps = self._score(self.train_dataset, mine, episodes)
        rewards = acc.gather(local_rewards.to(acc.device)).cpu()  # (global N, F): groups are whole
        return Generated(rows, episodes.rollout, episodes.texts, rewards, self._gather_steps(local_steps, len(mine)),
                         failures, episodes.prompt_ids, episode_stats(episodes))

    def _advantages(self, rewards: torch.Tensor, steps: list, weights: torch.Tensor):
        """Advantages of the whole batch: (N,) from outcome rewards, or (N, max_completion_length) when a reward
        function scored steps (outcome advantage + each process function's per-token advantage)."""
        args = self.args
        advantages, stats = group_advantages(
            rewards, weights, args.num_generations, args.multi_objective_aggregation, args.scale_rewards,
            args.advantage_estimator,
        )
        stats["step_reward_mean"] = {}
        for f, per_completion in enumerate(steps):
            if per_completion is None:
                continue
            step_adv, step_stats = process_advantages(
                per_completion, args.num_generations, args.max_completion_length, args.scale_rewards, float(weights[f])
            )
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(-1).expand(-1, args.max_completion_length)
            advantages = advantages + step_adv.to(advantages.dtype)
            stats["step_reward_mean"][f] = step_stats["step_reward_mean"]
        return advantages, stats

    def _with_kl_penalty(self, rewards: torch.Tensor, trainer_logp: torch.Tensor, exp: Experience):
        """rewards (N, F) -> (N, F + 1): a column -beta * sum_t k(log pi_old, log pi_ref) over counted tokens, NaN
        where no reward function scored the completion (so it stays unscored)."""
        acc = self.accelerator
        kl = KL_ESTIMATORS[self.args.kl_estimator](trainer_logp, exp.ref_logp)  # (n, T)
        local = (kl * exp.loss_mask).sum(-1)  # (n,)
        penalty = -self.args.beta * acc.gather(local.to(acc.device)).cpu().to(rewards.dtype)  # (N,)
        scored = ~torch.isnan(rewards).all(-1)
        penalty = torch.where(scored, penalty, torch.full_like(penalty, float("nan")))
        weights = torch.cat([self.reward_weights, torch.ones(1)])
        return torch.cat([rewards, penalty.unsqueeze(-1)], -1), weights, self.reward_names + ["kl_penalty"]

    def _dynamic_sampling(self, gen: "Generated") -> tuple["Generated", dict[str, float]]:
        """DAPO's dynamic sampling: keep the groups whose advantages are not all 0 and generate more rounds (each
        with fresh prompts) until a batch's worth is kept, or dynamic_sampling_max_rounds rounds ran; then fill the
        rest with the first groups dropped. Every process takes the same decisions (they read gathered rewards)."""
        args = self.args
        groups = len(gen.rows) // args.num_generations
        rounds, kept, flat = [gen], [], []
        while True:
            advantages, _ = self._advantages(rounds[-1].rewards, rounds[-1].steps, self.reward_weights)
            informative = advantages.reshape(groups, -1).ne(0).any(-1).tolist()
            for g, useful in enumerate(informative):
                (kept if useful else flat).append((len(rounds) - 1, g))
            if len(kept) >= groups or len(rounds) >= args.dynamic_sampling_max_rounds:
                break
            rounds.append(self._sample_round())
        chosen = kept[:groups]
        filled = groups - len(chosen)
        if filled:
            chosen += flat[:filled]
            logger.warning(
                "Dynamic sampling: only %d of %d groups had different rewards after %d rounds "
                "(dynamic_sampling_max_rounds); the batch is filled with %d groups whose rewards are all equal. "
                "The task may be too easy or too hard for the model now.", len(kept), groups, len(rounds), filled,
            )
        metrics = {
            "dynamic_sampling/rounds": len(rounds),
            "dynamic_sampling/dropped_groups": len(flat) - filled,
            "dynamic_sampling/extra_completions": (len(rounds) - 1) * len(gen.rows),
            "dynamic_sampling/filled_with_flat": filled,
        }
        if chosen == [(0, g) for g in range(groups)]:
            return gen, metrics
        return self._compose(rounds, chosen), metrics

    def _compose(self, rounds: list["Generated"], chosen: list[tuple[int, int]]) -> "Generated":
        """A generation batch made of the chosen (round, group) pairs; completions move between processes."""
        acc, size = self.accelerator, self.args.num_generations
        payloads = []  # per round: every process's rows as (tokens, log-probs, text, prompt, tool mask, truncated, stats)
        for gen in rounds:
            mask = gen.rollout.completion_mask.bool()
            logprobs, tool_mask = gen.rollout.logprobs, gen.rollout.tool_mask
            local = [
                (gen.rollout.completion_ids[i][mask[i]].tolist(),
                 None if logprobs is None else logprobs[i][mask[i]].tolist(), gen.texts[i], gen.prompt_ids[i],
                 None if tool_mask is None else tool_mask[i][mask[i]].tolist(), bool(gen.rollout.truncated[i]),
                 gen.tool_stats[i].tolist())
                for i in range(len(gen.texts))
            ]
            payloads.append(gather_object(local) if acc.num_processes > 1 else local)
        picked = [(r, g * size + j) for r, g in chosen for j in range(size)]  # (round, global row)
        n_local = len(picked) // acc.num_processes
        mine = picked[acc.process_index * n_local : (acc.process_index + 1) * n_local]
        rows = [payloads[r][i] for r, i in mine]
        with_logprobs, multi_turn = rows[0][1] is not None, rows[0][4] is not None
        rollout = pad_rollout(
            [row[0] for row in rows], [row[1] for row in rows] if with_logprobs else None, self.eos_ids,
            self.tokenizer.pad_token_id, tool_masks=[row[4] for row in rows] if multi_turn else None,
            truncated=[row[5] for row in rows],
        )
        steps = [
            None if all(gen.steps[f] is None for gen in rounds)
            else [None if rounds[r].steps[f] is None else rounds[r].steps[f][i] for r, i in picked]
            for f in range(len(rounds[0].steps))
        ]
        return Generated(
            rows=[rounds[r].rows[i] for r, i in picked], rollout=rollout, texts=[row[2] for row in rows],
            rewards=torch.stack([rounds[r].rewards[i] for r, i in picked]), steps=steps,
            failures=[sum(gen.failures[f] for gen in rounds) for f in range(len(rounds[0].failures))],
            prompt_ids=[row[3] for row in rows], tool_stats=torch.tensor([row[6] for row in rows], dtype=torch.long),
        )

    def _score(self, dataset, rows: list[int], episodes: Episodes, funcs=None):
        """Local reward matrix (N, F), failure counts, and per function the step rewards as (token index, reward)
        lists (None for outcome functions); a failure on any process stops every process with the same message.
        `funcs`: other functions with the reward contract (compute_metrics) instead of the reward functions."""
        columns = dataset[rows]  # {column: values of these rows}, rows may repeat
        prompts = columns.pop("prompt")
        if episodes.environments is not None:  # TRL: reward functions get each episode's environment, and the
            columns["environments"] = episodes.environments  # prompts as reset() extended them
            prompts = episodes.prompts
        completions, rollout = episodes.completions, episodes.rollout
        completion_ids = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        error = None
        try:
            scores = score_completions(
                funcs or self.reward_funcs, prompts, completions, completion_ids, columns, self.state,
                error_policy=self.args.reward_error_policy,
                log_extra=self._reward_logs.log_extra, log_metric=self._reward_logs.log_metric,
            )
        except RewardError as exc:
            error = exc
        if self.accelerator.num_processes > 1:
            messages = gather_object([str(error) if error else None])
            failed = [(rank, m) for rank, m in enumerate(messages) if m]
            if failed and error is None:
                rank, message = failed[0]
                raise RewardError(f"Reward scoring failed on process {rank}: {message}")
        if error is not None:
            raise error
        steps = [None if s is None else self._token_steps(s, completion_ids) for s in scores.steps]
        return scores.rewards.float(), list(scores.failures), steps

    def _token_steps(self, per_completion: list, completion_ids: list[list[int]]) -> list:
        """(character end offset, reward) step lists -> (token index, reward) lists, per completion."""
        out = []
        for pairs, ids in zip(per_completion, completion_ids):
            if not pairs or not ids:
                out.append(None)
                continue
            ends = offsets_to_token_indices(token_char_ends(self.tokenizer, ids), [offset for offset, _ in pairs])
            out.append([(index, reward) for index, (_, reward) in zip(ends, pairs)])
        return out

    def _gather_steps(self, local_steps: list, local_count: int) -> list:
        """Per function: None (an outcome function on every process) or the step lists of all N completions."""
        if self.accelerator.num_processes == 1:
            return local_steps
        everyone = gather_object([local_steps])  # one entry per process
        return [
            None if all(part[f] is None for part in everyone)
            else [item for part in everyone for item in (part[f] if part[f] is not None else [None] * local_count)]
            for f in range(len(local_steps))
        ]

    def _generation_metrics(self, rollout, stats, failures, generation_seconds, names) -> dict[str, float]:
        acc = self.accelerator
        lengths = acc.gather(rollout.model_mask.sum(-1).to(acc.device)).float()  # the model's tokens only
        truncated = acc.gather(rollout.truncated.to(acc.device)).float()
        tokens = lengths.sum().item()
        self.state.num_input_tokens_seen += int(tokens)
        total = stats["reward"]
        metrics = {
            "reward": torch.nanmean(total).item(),
            "reward_std": stats["reward_group_std"].mean().item(),
            "frac_reward_zero_std": stats["frac_reward_zero_std"].item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            "tokens_per_second": tokens / max(generation_seconds, 1e-9),
            "generation_seconds": generation_seconds,
            "num_tokens": self.state.num_input_tokens_seen,
        }
        failure_counts = acc.reduce(torch.tensor(failures, dtype=torch.long, device=acc.device), "sum").tolist()
        for k, name in enumerate(names):
            if k in stats["step_reward_mean"]:  # a process function: the mean of its step rewards
                metrics[f"rewards/{name}/step_mean"] = stats["step_reward_mean"][k].item()
                continue
            metrics[f"rewards/{name}/mean"] = stats["reward_func_mean"][k].item()
            metrics[f"rewards/{name}/std"] = stats["reward_func_std"][k].item()
            if self.args.reward_error_policy == "none" and k < len(failure_counts):
                metrics[f"rewards/{name}/failures"] = failure_counts[k]
        return metrics

    def _tool_metrics(self, stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """Multi-turn rollouts, from every process's episode_stats: tools/call_frequency (tool calls per
        completion), tools/failure_frequency (failed calls / calls, 0 without calls), tools/turns_mean (model turns
        per episode), completions/tool_tokens_mean (tokens written by tools and environments per completion;
        completions/mean_length counts the model's)."""
        acc = self.accelerator
        calls, failures, turns, tokens = acc.gather(stats.float().to(acc.device)).cpu().unbind(-1)
        return {
            f"{prefix}tools/call_frequency": calls.mean().item(),
            f"{prefix}tools/failure_frequency": (failures.sum() / calls.sum()).item() if calls.sum() > 0 else 0.0,
            f"{prefix}tools/turns_mean": turns.mean().item(),
            f"{prefix}completions/tool_tokens_mean": tokens.mean().item(),
        }

    def _reduce_extremes(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per-process metric tensors -> floats over all processes: keys ending /min or /max by min or max, others
        by the mean of the processes' values."""
        acc, out = self.accelerator, {}
        for key, value in metrics.items():
            value = value.detach().float().to(acc.device)
            if acc.num_processes > 1:
                value = acc.gather(value.reshape(1))
                value = value.min() if key.endswith("/min") else value.max() if key.endswith("/max") else value.mean()
            out[key] = value.item()
        return out

    def _reward_metrics(self, logged: dict[str, list[float]]) -> dict[str, float]:
        """The numbers reward functions logged with log_metric: each name's mean over every process's calls."""
        if self.accelerator.num_processes > 1:
            merged: dict[str, list[float]] = {}
            for part in gather_object([logged]):
                for name, values in part.items():
                    merged.setdefault(name, []).extend(values)
            logged = merged
        clash = sorted(set(logged) & set(self._last_generation_metrics))
        if clash:
            raise RewardError(f"log_metric({clash[0]!r}, ...) from a reward function: {clash[0]!r} is a metric the "
                              "trainer logs itself; give yours another name (e.g. 'rewards/my_" f"{clash[0]}').")
        return {name: sum(values) / len(values) for name, values in logged.items() if values}

    def _log_completions(self, writer, rows, texts, rewards, advantages, extra=None) -> None:
        upcoming = self.state.global_step + 1  # the optimizer step this batch is generated for
        due = self.args.log_completions and (upcoming % self.args.completions_logging_steps == 0 or upcoming == 1)
        if not due and not self.args.num_completions_to_print:
            return
        prompts = self.train_dataset[rows]["prompt"]
        # with step rewards the advantage is per token; its first token's holds every step's share
        first_token_advantages = advantages[:, 0] if advantages.dim() == 2 else advantages
        records = [
            {
                "step": upcoming,
                "prompt": p,
                "completion": t,
                "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(self.reward_names, r.tolist())},
                "advantage": a,
            }
            for p, t, r, a in zip(prompts, texts, rewards, first_token_advantages.tolist())
        ]
        for column, values in (extra or {}).items():  # log_extra columns, where they cover this batch
            if len(values) == len(records):
                for record, value in zip(records, values):
                    record.setdefault(column, value)
        if self.args.num_completions_to_print:
            self._recent_completions = records[: self.args.num_completions_to_print]  # this process's first rows
        if not due:
            return
        gathered = gather_object(records) if self.accelerator.num_processes > 1 else records
        if writer is not None:
            writer.log_completions(gathered)

    # ------------------------------------------------------------------ log-probs
    def _forward_logprobs(
        self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=False, entropy_grad=False
    ):
        """(b, T) log-probs of the completion tokens (and their entropies) from one forward pass."""
        device = self.accelerator.device
        # Each distinct prompt runs once, except where a second forward before backward would confuse DDP's
        # gradient hooks or gradient checkpointing (which turns the KV cache off).
        ddp_with_grad = isinstance(model, torch.nn.parallel.DistributedDataParallel) and torch.is_grad_enabled()
        share = not ddp_with_grad and not getattr(model, "is_gradient_checkpointing", False)
        with self._autocast():
            return completion_logprobs(
                model, prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                completion_mask.to(device), self.args.temperature, with_entropy=entropy, share_prompts=share,
                entropy_grad=entropy_grad,
            )  # (b, T) each: position t is completion token t; no (b, T, V) logits are held

    @torch.no_grad()
    def _batched_logprobs(self, model, exp: Experience) -> torch.Tensor:
        """No-grad log-probs of the whole local batch, in micro-batch-sized chunks: (N, T) on CPU."""
        size = self.args.per_device_train_batch_size
        pieces = []
        for start in range(0, exp.completion_ids.shape[0], size):
            rows = slice(start, start + size)
            logp, _ = self._forward_logprobs(
                model, exp.prompt_ids[rows], exp.prompt_mask[rows], exp.completion_ids[rows], exp.completion_mask[rows]
            )
            pieces.append(logp.float().cpu())
        return torch.cat(pieces)

    # ------------------------------------------------------------------ 2. the update
    def _micro_batches(self, exp: Experience) -> list[slice]:
        ga, size = self.args.gradient_accumulation_steps, self.args.per_device_train_batch_size
        out = []
        for k in range(exp.cursor, exp.cursor + ga):
            start = (k % self.spg) * size
            out.append(slice(start, start + size))
        return out

    def _optimizer_step(self, exp: Experience) -> dict[str, Any]:
        args, acc = self.args, self.accelerator
        batches = self._micro_batches(exp)
        local_tokens = sum(exp.loss_mask[rows].sum() for rows in batches).to(acc.device).float()
        token_normalizer = acc.reduce(local_tokens, "sum") / acc.num_processes
        # no counted token anywhere (every completion truncated and masked): a zero loss, not 0/0
        token_normalizer = torch.where(token_normalizer > 0, token_normalizer, torch.ones_like(token_normalizer))
        token_sums: dict[str, torch.Tensor] = {}  # token-weighted, so splits across processes don't matter
        step_loss = torch.zeros((), device=acc.device)
        step_bonus = None  # the entropy bonus's part of the loss, when it is on
        settings = dataclasses.replace(self.loss_settings, entropy_coef=self._applied_entropy_coef())
        entropy_stats = torch.zeros(2, device=acc.device)  # (entropy sum, tokens) over the policy term's tokens
        for index, rows in enumerate(batches):
            sync = index == len(batches) - 1
            with contextlib.nullcontext() if sync else acc.no_sync(self.model):
                loss, metrics, stats = self._micro_batch_loss(exp, rows, len(batches), token_normalizer, settings)
                acc.backward(loss)
            entropy_stats += stats
            step_loss += loss.detach().float()
            if "entropy_bonus" in metrics:
                bonus = metrics.pop("entropy_bonus").float()
                step_bonus = bonus if step_bonus is None else step_bonus + bonus
            tokens = exp.loss_mask[rows].sum().to(acc.device).float()
            for key, value in {**metrics, "tokens": torch.ones((), device=acc.device)}.items():
                token_sums[key] = token_sums.get(key, 0.0) + value.detach().float() * tokens
        exp.cursor += len(batches)
        max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        # Every process must take the same decision, so the flag is summed over processes.
        bad = (~torch.isfinite(step_loss) | ~torch.isfinite(torch.as_tensor(grad_norm))).float().to(acc.device)
        skipped = bool(acc.reduce(bad, "sum").item() > 0)
        if skipped:  # drop the gradients; neither the optimizer nor the schedule advances
            self.state.nonfinite_skips += 1
            self.state.consecutive_nonfinite_steps += 1
        else:
            self.state.consecutive_nonfinite_steps = 0
            self.optimizer.step()
            self.scheduler.step()
            self._weights_version += 1
            self._update_entropy_coef(acc.reduce(entropy_stats, "sum"))
        self.optimizer.zero_grad(set_to_none=True)
        if self.state.consecutive_nonfinite_steps >= args.max_consecutive_nonfinite_steps:
            raise NonFiniteError(
                f"The loss or gradient norm was NaN/inf in {self.state.consecutive_nonfinite_steps} optimizer steps in "
                f"a row (up to step {self.state.global_step + 1}: loss={step_loss.item()}, grad_norm={float(grad_norm)}), "
                "so training stopped. Lower learning_rate, keep max_grad_norm > 0, try bf16=False, check the model "
                "loads without NaN weights, or resume from an earlier checkpoint; max_consecutive_nonfinite_steps "
                "sets how many skipped steps in a row are tolerated."
            )
        token_sums = {key: acc.reduce(value, "sum") for key, value in token_sums.items()}
        total_tokens = token_sums.pop("tokens").clamp(min=1.0)
        out = {key: value / total_tokens for key, value in token_sums.items()}
        out["loss"] = acc.reduce(step_loss, "mean")  # DDP averages gradients, so the step's loss is the mean
        if step_bonus is not None:  # policy_loss: the loss without the entropy bonus (loss = policy_loss - bonus)
            out["policy_loss"] = acc.reduce(step_loss + step_bonus, "mean")
        out["grad_norm"] = grad_norm
        out["nonfinite_skipped"] = int(skipped)
        out["nonfinite_skips"] = self.state.nonfinite_skips
        if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
            out["entropy_coef"] = self.state.entropy_coef
        return out

    def _applied_entropy_coef(self) -> float:
        """The entropy bonus's coefficient for this step: adaptive control applies it only at or below the target."""
        if self.args.use_adaptive_entropy and self.state.last_entropy > self.args.entropy_target:
            return 0.0
        return self.state.entropy_coef

    def _update_entropy_coef(self, stats: torch.Tensor) -> None:
        """Adaptive entropy control (Skywork-OR1), after a step: coefficient +delta when the step's entropy was at
        or below entropy_target, -delta above it, kept within [entropy_coef_min, entropy_coef_max]."""
        args = self.args
        if not args.use_adaptive_entropy:
            return
        entropy = (stats[0] / stats[1].clamp(min=1.0)).item()
        step = args.entropy_coef_delta if entropy <= args.entropy_target else -args.entropy_coef_delta
        self.state.entropy_coef = min(max(self.state.entropy_coef + step, args.entropy_coef_min), args.entropy_coef_max)
        self.state.last_entropy = entropy

    def _micro_batch_loss(self, exp: Experience, rows: slice, num_micro_batches: int, token_normalizer, settings):
        """Loss, metrics and (entropy sum, token count) over the policy term's tokens, for one micro-batch."""
        width = int(exp.completion_mask[rows].sum(-1).max().clamp(min=1))  # trim padding shared by the rows
        prompt_width = int(exp.prompt_mask[rows].sum(-1).max())
        prompt_ids, prompt_mask = exp.prompt_ids[rows, -prompt_width:], exp.prompt_mask[rows, -prompt_width:]
        completion_ids, completion_mask = exp.completion_ids[rows, :width], exp.completion_mask[rows, :width]
        device = self.accelerator.device
        logp, entropy = self._forward_logprobs(
            self.model, prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=True,
            entropy_grad=settings.entropy_coef != 0.0,
        )
        loss_mask = exp.loss_mask[rows, :width].to(device)

        def part(t):
            return None if t is None else t[rows, :width].to(device)

        advantages = exp.advantages[rows]
        advantages = (advantages[:, :width] if advantages.dim() == 2 else advantages).to(device)
        threshold = None
        if self.args.top_entropy_quantile < 1.0:
            threshold = self._entropy_threshold(entropy.detach(), loss_mask)
        batch = LossBatch(
            logp, advantages, loss_mask, old_logp=part(exp.old_logp), ref_logp=part(exp.ref_logp),
            sampling_logp=part(exp.sampling_logp), sampling_weights=part(exp.sampling_weights), entropy=entropy,
            entropy_threshold=threshold, num_micro_batches=num_micro_batches, token_normalizer=token_normalizer,
        )
        loss, metrics = policy_loss(batch, settings)
        metrics["entropy"] = masked_mean(entropy.detach(), loss_mask)
        policy_tokens = loss_mask if threshold is None else loss_mask * (entropy.detach() >= threshold)
        stats = torch.stack([(entropy.detach() * policy_tokens).sum(), policy_tokens.sum()]).float()
        return loss, metrics, stats

    def _entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """top_entropy_quantile's entropy threshold over the micro-batch's counted tokens on every process."""
        counted = _counted_entropies(self.accelerator, entropy, mask)
        return entropy_quantile_threshold(counted, self.args.top_entropy_quantile).to(entropy.device)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: True where a counted token's entropy is at or above the `threshold` quantile (0..1) of the
        counted tokens' entropies on every process. Shapes: entropies, mask (B, T) -> (B, T) bool."""
        counted = _counted_entropies(self.accelerator, entropies, mask)
        if counted.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        cut = entropy_quantile_threshold(counted, 1.0 - threshold).to(entropies.device)
        return (entropies >= cut) & mask.bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's method: DeepSeek-V3.2's off-policy sequence mask (grpokit.algorithms.off_policy_mask), 1 keeps
        a sequence. Shapes: advantages (B, 1), the rest (B, T) -> (B, 1)."""
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                               off_policy_threshold).to(mask.dtype)

    @property
    def tools(self) -> list:
        """TRL's attribute: every tool the model may call, the standalone ones and each environment's methods."""
        by_name = dict(self.toolbox.functions)
        for methods in (self.environments.tools.values() if self.environments is not None else []):
            for method in methods:
                by_name.setdefault(method.__name__, method)
        return list(by_name.values())

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's name for the reward functions' metric names (reward_names), environments' get_reward included."""
        return list(self.reward_names)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (it moves with use_adaptive_entropy)."""
        return self.state.entropy_coef

    @torch.no_grad()
    def _sync_reference(self) -> None:
        """TR-DPO: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, parameter by parameter."""
        alpha = self.args.ref_model_mixup_alpha
        policy = dict(self.unwrapped.named_parameters())
        for name, ref_param in self.ref_model.named_parameters():
            ref_param.mul_(1.0 - alpha).add_(policy[name].detach().to(ref_param.dtype), alpha=alpha)


    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Evaluate on the trainer's eval sets (or on `eval_dataset`: a Dataset, or named ones as a dict) and
        return the metrics (see _evaluate) under grpokit's names (eval/reward, eval/<set>/loss) and TRL's
        (eval_reward, eval_<set>_loss); the log_history row has grpokit's names."""
        if eval_dataset is None:
            sets = self.eval_datasets
            result = self._evaluate(None)
        else:
            sets = _eval_rows(eval_dataset)
            if self.environments is not None:
                for dataset in sets.values():
                    self.environments.check_rows(dataset)
            ids = {name: self._tokenize_prompts(ds, f" of {_eval_label(name)}") for name, ds in sets.items()}
            result = self._evaluate(None, sets, ids)
        return {**result, **trl_metric_names(result, list(sets))}

    def _evaluate(self, writer: MetricsWriter | None, sets=None, prompt_ids=None) -> dict[str, float]:
        """Mean rewards of num_generations_eval sampled completions per eval prompt: eval/reward,
        eval/rewards/<function>/mean and the compute_metrics results (eval_metric_summary); a named eval set's
        under eval/<name>/. Generated per_device_eval_batch_size completions at a time. Every process evaluates
        every row (the counter-based sampler makes their results identical), which keeps their collective calls
        in step."""
        sets = self.eval_datasets if sets is None else sets
        prompt_ids = self.eval_prompt_ids if prompt_ids is None else prompt_ids
        if not sets:
            raise ConfigError("evaluate() needs an eval_dataset; pass eval_dataset=... to GRPOTrainer.")
        result: dict[str, float] = {"step": self.state.global_step}
        for name, dataset in sets.items():
            prefix = "eval/" if name is None else f"eval/{name}/"
            result.update(self._evaluate_set(dataset, prompt_ids[name], prefix))
        self._last_eval_step = self.state.global_step
        self.state.log_history.append(result)
        if writer is not None:
            self._watch(writer.log(result))
        # TRL's names as well (eval_reward for eval/reward), which callbacks such as EarlyStoppingCallback read;
        # called before the best model is updated, as transformers does, so state.best_metric is the previous best
        self.callbacks.event("on_evaluate", metrics={**result, **trl_metric_names(result, list(sets))})
        self._track_best(result)
        return result

    @torch.no_grad()
    def _evaluate_set(self, dataset, ids: list[list[int]], prefix: str) -> dict[str, float]:
        args = self.args
        group = args.num_generations_eval or args.num_generations
        rows = [r for r in range(len(dataset)) for _ in range(group)]
        chunk = args.per_device_eval_batch_size or args.per_device_train_batch_size * self.spg
        scores, metric_scores, chunks = [], [], []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            sample_ids = torch.arange(start, start + len(part)) + 2**40  # apart from the training samples' ids
            episodes = self._episodes(dataset, part, [ids[r] for r in part], sample_ids)
            chunks.append(episodes)
            scores.append(self._score(dataset, part, episodes)[0])
            if self.metric_funcs:
                metric_scores.append(self._score(dataset, part, episodes, self.metric_funcs)[0])
        rewards = torch.cat(scores)  # (rows, F)
        advantages, _ = group_advantages(rewards, self.reward_weights, group, args.multi_objective_aggregation,
                                         args.scale_rewards, args.advantage_estimator)
        applicable = ~torch.isnan(rewards)
        totals = torch.where(applicable, rewards * self.reward_weights, torch.zeros_like(rewards)).sum(-1)
        totals = torch.where(applicable.any(-1), totals, torch.full_like(totals, float("nan")))  # None: not counted
        result = {f"{prefix}reward": torch.nanmean(totals).item(), f"{prefix}loss": self._eval_loss(chunks, advantages)}
        if self.agentic:
            result.update(self._tool_metrics(torch.cat([episode_stats(e) for e in chunks]), prefix))
        for k, name in enumerate(self.reward_names):
            result[f"{prefix}rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
        if self.metric_funcs:
            values = torch.cat(metric_scores).reshape(len(dataset), group, -1)  # (prompts, G, metrics)
            for k, func in enumerate(self.metric_funcs):
                result.update(eval_metric_summary(func.name, values[..., k], prefix))
        return result

    def _eval_loss(self, chunks: list[Episodes], advantages: torch.Tensor) -> float:
        """The training loss on the eval completions, on-policy (every ratio 1), from their group advantages
        (outcome rewards only): the mean over the completions of each chunk's policy_loss, chunks weighted by
        their completions."""
        args, device, total, start = self.args, self.accelerator.device, 0.0, 0
        for episodes in chunks:
            rollout, part = episodes.rollout, episodes.prompt_ids
            prompt_ids, prompt_mask = left_pad(episodes.prompt_ids, self.tokenizer.pad_token_id)
            mask = rollout.model_mask.clone()
            if args.mask_truncated_completions:
                mask[rollout.truncated] = 0
            logp, entropy = self._forward_logprobs(self.model, prompt_ids, prompt_mask, rollout.completion_ids,
                                                   rollout.completion_mask,
                                                   entropy=self.loss_settings.entropy_coef != 0.0)
            ref_logp = None
            if self.ref_model is not None:
                ref_logp, _ = self._forward_logprobs(self.ref_model, prompt_ids, prompt_mask, rollout.completion_ids,
                                                     rollout.completion_mask)
            elif args.beta != 0.0:
                with self.unwrapped.disable_adapter():
                    ref_logp, _ = self._forward_logprobs(self.model, prompt_ids, prompt_mask, rollout.completion_ids,
                                                         rollout.completion_mask)
            batch = LossBatch(logp, advantages[start : start + len(part)].to(device), mask.to(device),
                              ref_logp=ref_logp, entropy=entropy)
            total += policy_loss(batch, self.loss_settings)[0].item() * len(part)
            start += len(part)
        return total / max(start, 1)

    def _track_best(self, result: dict[str, float]) -> None:
        """Save the model to OUTPUT_DIR/best when the evaluation improved metric_for_best_model."""
        args = self.args
        name = args.metric_for_best_model or ("eval/reward" if args.load_best_model_at_end else None)
        if name is None:
            return
        key = eval_key(name)
        if key not in result:
            raise ConfigError(f"metric_for_best_model={name!r} is not an eval metric; this run logs: "
                              f"{', '.join(k for k in result if k != 'step')}.")
        value, best = result[key], self.state.best_metric
        larger = args.greater_is_better is not False
        if math.isnan(value) or (best is not None and (value <= best if larger else value >= best)):
            return
        self.state.best_metric = value
        folder = Path(args.output_dir) / "best"
        staging = Path(args.output_dir) / ".best-staging"
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            self._write_model(staging)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            write_json(folder / "best.json", {"step": self.state.global_step, key: value})
        self.accelerator.wait_for_everyone()
        self.state.best_model_checkpoint = str(folder)

    def _health_monitor(self) -> HealthMonitor:
        """Run-health alarms (grpokit/health.py) over the logged rows; a resumed run replays its history first,
        so an alarm raised before the checkpoint is not raised again."""
        args = self.args
        lower = ()
        if args.metric_for_best_model and args.greater_is_better is False:
            name = args.metric_for_best_model
            lower = (eval_key(name),)
        monitor = HealthMonitor(beta=0.0 if args.kl_in_reward else args.beta, lower_is_better=lower,
                                reward_weights=dict(zip(self.reward_names, self.reward_weights.tolist())))
        for row in self.state.log_history:
            monitor.update(row)
        return monitor

    def _watch(self, row: dict[str, Any]) -> None:
        for alarm in self.health.update(row):
            logger.warning("%s", alarm)

    def _print_completions(self) -> None:
        """The first num_completions_to_print completions of the newest generation batch, to stderr."""
        for record in self._recent_completions:
            rewards = ", ".join(f"{name}={value}" for name, value in record["rewards"].items())
            print(f"[step {record['step']}] {record['prompt']!r} -> {record['completion']!r} ({rewards})",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ 3. checkpoints
    def save_model(self, folder: str) -> None:
        """The model and tokenizer into `folder`, atomically: written to a staging folder beside it, then each file
        renamed into place, so a failed save (a full disk) leaves the previous files as they were."""
        acc, folder = self.accelerator, Path(folder)
        acc.wait_for_everyone()
        if acc.is_main_process:
            staging = folder.parent / f".{folder.name}.model-staging"
            try:
                shutil.rmtree(staging, ignore_errors=True)
                self._write_model(staging)
                folder.mkdir(parents=True, exist_ok=True)
                for path in staging.iterdir():
                    os.replace(path, folder / path.name)
            except OSError as exc:
                raise SaveError(f"Saving the model to {folder} failed: {exc} ({free_space(folder)} free there). The "
                                "files already in that folder are unchanged; free some space and call save_model "
                                "again, or resume from the newest checkpoint.") from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        acc.wait_for_everyone()

    def _write_model(self, folder: Path) -> None:
        self.unwrapped.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def save_checkpoint(self) -> Path:
        acc, step = self.accelerator, self.state.global_step
        staging = staging_dir(self.args.output_dir, step)
        if acc.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        try:
            self._write_checkpoint_files(staging)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise SaveError(f"Saving checkpoint-{step} to {staging} failed: {exc} ({free_space(staging)} free "
                            "there). Earlier checkpoints are unchanged; free some space and resume.") from exc
        final = Path(self.args.output_dir) / f"checkpoint-{step}"
        if acc.is_main_process:
            state = {
                "trainer": dataclasses.asdict(self.state),
                "sampler": dataclasses.asdict(self.sampler.state),
                "last_generation_metrics": getattr(self, "_last_generation_metrics", {}),
                "num_processes": acc.num_processes,
                "manifest": manifest(staging),  # size and SHA-256 of every file, checked before a resume
            }
            write_json(staging / STATE_FILE, state)  # written last: marks the folder complete
            final = publish(staging, self.args.output_dir, step, self.args.save_total_limit)
        acc.wait_for_everyone()
        self.callbacks.event("on_save")
        return final

    def _write_checkpoint_files(self, staging: Path) -> None:
        acc = self.accelerator
        torch.save(rng_state(), staging / f"rng_state_{acc.process_index}.pt")
        if self.experience is not None:
            torch.save(dataclasses.asdict(self.experience), staging / f"experience_{acc.process_index}.pt")
        if acc.is_main_process:
            self._write_model(staging)
            torch.save(self.optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), staging / "scheduler.pt")
            if self.args.sync_ref_model:  # the synced reference has moved away from the starting weights
                save_model(self.ref_model, str(staging / REFERENCE_FILE))
        acc.wait_for_everyone()

    def _verified(self, checkpoint: Path, picked_newest: bool) -> Path:
        """`checkpoint` when every file matches its manifest; else, with resume_fallback and a checkpoint picked
        as the newest, the newest older one that verifies; else a CheckpointError naming the damage."""
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        older = newest_verified(self.args.output_dir, before=checkpoint)
        if older is not None and picked_newest and self.args.resume_fallback:
            logger.warning("Skipping %s: %s. Resuming from %s, the newest older checkpoint that verifies.",
                           checkpoint, problem, older)
            return older
        advice = (f"The newest older checkpoint that verifies is {older}: resume from it with "
                  f"resume_from_checkpoint='{older}', or set resume_fallback=True (--resume_fallback true) so that "
                  "--resume picks it." if older is not None else
                  "No older checkpoint verifies; start again with overwrite_output_dir=True or another output_dir.")
        raise CheckpointError(f"Cannot resume from {checkpoint}: {problem}. {advice}")

    def _resolve_resume(self, resume: bool | str | None) -> Path | None:
        out = self.args.output_dir
        if self.accelerator.is_main_process:
            remove_stale_staging(out)
        self.accelerator.wait_for_everyone()
        if resume is None or resume is False:
            if checkpoint_dirs(out) and not self.args.overwrite_output_dir:
                raise ConfigError(
                    f"{out} already holds checkpoints; resume with train(resume_from_checkpoint=True) / --resume, "
                    "set overwrite_output_dir=True, or choose another output_dir."
                )
            if self.accelerator.is_main_process:
                for name in ("metrics.jsonl", "completions.jsonl"):
                    (Path(out) / name).unlink(missing_ok=True)
            return None
        checkpoint = newest_checkpoint(out) if resume is True else Path(resume)
        if checkpoint is None:
            raise ConfigError(f"resume_from_checkpoint=True but {out} holds no complete checkpoint-<step> folder.")
        if not (checkpoint / STATE_FILE).is_file():
            raise ConfigError(f"{checkpoint} is not a complete checkpoint (no {STATE_FILE}).")
        return self._verified(checkpoint, picked_newest=resume is True)

    def _load_checkpoint(self, checkpoint: Path) -> None:
        acc = self.accelerator
        saved = read_state(checkpoint)
        if saved["num_processes"] != acc.num_processes:
            raise ConfigError(
                f"{checkpoint} was written by {saved['num_processes']} processes; resume it with the same number."
            )
        load_weights(self.unwrapped, checkpoint)
        self._weights_version += 1  # the engine must be given the checkpoint's weights
        self.optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=False))
        self.scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=False))
        set_rng_state(torch.load(checkpoint / f"rng_state_{acc.process_index}.pt", weights_only=False))
        if self.args.sync_ref_model and (checkpoint / REFERENCE_FILE).is_file():
            load_model(self.ref_model, str(checkpoint / REFERENCE_FILE), device=str(acc.device))
        self.state = TrainerState(**{**saved["trainer"], "is_world_process_zero": acc.is_main_process,
                                     "is_local_process_zero": acc.is_local_main_process})
        self.state.max_steps = self._total_steps()  # this run's max_steps, not the checkpointed run's
        self.sampler.state = SamplerState(**saved["sampler"])
        self._last_generation_metrics = saved["last_generation_metrics"]
        buffer = checkpoint / f"experience_{acc.process_index}.pt"
        self.experience = Experience(**torch.load(buffer, weights_only=False)) if buffer.is_file() else None
        if acc.is_main_process:
            for name in ("metrics.jsonl", "completions.jsonl"):
                trim_jsonl(Path(self.args.output_dir) / name, self.state.global_step)
        logger.info("Resumed from %s at step %d.", checkpoint, self.state.global_step)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self):
        def request_stop(signum, frame):
            self._stop_signal = signum

        try:
            return {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread: leave signals alone
            return {}

    @staticmethod
    def _restore_signal_handlers(previous) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _stop_requested(self) -> bool:
        flag = torch.tensor(float(self._stop_signal is not None), device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "sum").item() > 0)


def _disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability to 0 (the modules and the config fields models read at forward time)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def _check_output_dir(output_dir: str) -> None:
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".grpokit-write-test-{os.getpid()}"  # one per process: ranks check at the same time
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"output_dir {output_dir!r} is not writable ({exc.strerror}); choose another folder.") from exc


def _check_context(context: int | None, prompt_ids: list[list[int]], args: GRPOConfig) -> None:
    longest = max(len(p) for p in prompt_ids)
    if context is not None and longest + args.max_completion_length > context:
        raise ModelError(
            f"The longest prompt ({longest} tokens) plus max_completion_length={args.max_completion_length} exceeds "
            f"the model's context of {context} tokens; shorten prompts or lower max_completion_length."
        )


def trl_metric_names(result: dict[str, Any], sets: list[str | None]) -> dict[str, Any]:
    """Eval metrics under TRL's names: eval/<x> -> eval_<x>, a named set's eval/<set>/<x> -> eval_<set>_<x>."""
    out = {}
    for key, value in result.items():
        if not key.startswith("eval/"):
            continue
        rest = key[len("eval/"):]
        named = next((n for n in sets if n is not None and rest.startswith(f"{n}/")), None)
        out[f"eval_{named}_{rest[len(named) + 1:]}" if named else f"eval_{rest}"] = value
    return out


def eval_key(name: str) -> str:
    """metric_for_best_model as a logged key: "reward", "eval/reward" and TRL's "eval_reward" -> "eval/reward"."""
    if name.startswith("eval/"):
        return name
    return "eval/" + name.removeprefix("eval_")


def _counted_entropies(accelerator, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entropies of the counted tokens (mask 1) of every process, 1-D float32."""
    local = entropy[mask.bool()].float()
    if accelerator.num_processes > 1:  # entropies are >= 0, so a negative pad value marks padding
        padded = accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
        gathered = accelerator.gather(padded)
        local = gathered[gathered >= 0]
    return local


class RewardLogs:
    """What reward functions log through their log_extra / log_metric arguments, until drained."""

    def __init__(self) -> None:
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        """A completions-log column: one value per completion of the batch the function scored."""
        self.extra.setdefault(str(column), []).extend(list(values))

    def log_metric(self, name: str, value: float) -> None:
        """A number logged as `name`, averaged with the other values logged under it for the same step."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def drain(self) -> tuple[dict[str, list[Any]], dict[str, list[float]]]:
        out = (self.extra, self.metrics)
        self.extra, self.metrics = {}, {}
        return out


def _warn_sequence_level_token_sum(args: GRPOConfig) -> None:
    """GSPO's sequence-level ratio with an aggregation that sums tokens: each sequence then counts in proportion
    to its length, which is not GSPO's objective."""
    objective, aggregation = args.resolved_loss
    if args.importance_sampling_level == "sequence" and aggregation != "grpo" and objective in ("clip", "cispo"):
        logger.warning(
            "importance_sampling_level='sequence' with loss_type=%r: the loss adds up per-token terms, which weights "
            "each sequence by its completion length instead of optimising the per-sequence (GSPO) objective; set "
            "loss_type='grpo' for GSPO as published.", args.loss_type)


def _eval_rows(eval_dataset) -> dict[str | None, datasets.Dataset]:
    """eval_dataset as checked {name: Dataset} (see grpokit.data.eval_sets); a streaming set is read whole."""
    sets = {name: take_rows(ds, None, _eval_label(name)) if isinstance(ds, datasets.IterableDataset) else ds
            for name, ds in eval_sets(eval_dataset).items()}
    for name, ds in sets.items():
        check_dataset(ds, _eval_label(name))
    return sets


def _with_observation(prompt: Any, observation: str) -> Any:
    """A prompt with reset()'s text appended: to the string, or to the last message's content (a string, None, or
    a list of content parts, which gets a text part)."""
    if isinstance(prompt, str):
        return prompt + observation
    last = dict(prompt[-1])
    content = last.get("content")
    if isinstance(content, list):
        last["content"] = content + [{"type": "text", "text": observation}]
    else:
        last["content"] = (content or "") + observation
    return list(prompt[:-1]) + [last]


def _import_path(path: str, option: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{option}={path!r} cannot be imported ({exc}); check the module is on PYTHONPATH.") from exc


def episode_stats(episodes: Episodes) -> torch.Tensor:
    """(n, 4) per completion: tool calls, failed calls, model turns, tokens written by tools and environments."""
    rollout = episodes.rollout
    tool_tokens = (rollout.completion_mask - rollout.model_mask).sum(-1).tolist()
    return torch.tensor([episodes.tool_calls, episodes.tool_failures, episodes.turns, tool_tokens], dtype=torch.long).T


def _eval_label(name: str | None) -> str:
    """How errors name an eval set."""
    return "eval_dataset" if name is None else f"eval_dataset[{name!r}]"


def _refuse_unsupported(**given: Any) -> None:
    """TRL trainer arguments grpokit does not implement: refused when set, with what to do instead."""
    advice = {
        "quantization_config": "quantized (bitsandbytes) training needs CUDA and is not supported; load the model in "
                               "bf16 (bf16=True) or train a LoRA adapter (peft_config=...)",
        "rollout_func": "custom rollout functions are not supported yet; a custom rollout engine is (register "
                        "one with grpokit.rollout.register_rollout_engine, see docs/vllm.md)",
    }
    problems = [f"{name}: {advice[name]}." for name, value in given.items() if value is not None]
    if problems:
        raise ConfigError("GRPOTrainer got arguments grpokit does not support:\n  - " + "\n  - ".join(problems))
