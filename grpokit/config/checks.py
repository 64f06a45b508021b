"""The checks: every rule an option's value must follow, run by GRPOConfig.__post_init__ before any model loads.
Each message says what is wrong and how to fix it.

Choices come from the one table of each (a Registry, or a tuple of transformers' names): OPTION_CHOICES here, and
the tables that live with the code that dispatches on them (reward error policies, trackers, rollout engines, vLLM
modes, tool-call formats, tools). An engine's own options are checked by the engine (the check_options it was
registered with, grpokit.rollout.engine); report_to by grpokit.trackers.report_to_problems.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import TYPE_CHECKING, Any, Iterable

from grpokit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTION_MODES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    POLICY_OBJECTIVES,
    REWARD_SCALES,
    objective_aggregations,
)
from grpokit.errors import ConfigError, problems_message
from grpokit.trackers import TRACKERS, report_to_problems
from grpokit.trl_compat import AT_DEFAULT_ONLY, trl_option_problem

if TYPE_CHECKING:
    from grpokit.config.fields import GRPOConfig

# transformers' schedulers (get_scheduler) but reduce_lr_on_plateau, which needs an eval loss GRPO does not have
LR_SCHEDULER_TYPES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
    "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
)
SAVE_STRATEGIES = ("no", "steps", "epoch")
EVAL_STRATEGIES = ("no", "steps", "epoch")
MIN_TEMPERATURE = 0.01  # below it sampling is greedy in effect and 1/temperature scales the gradients

# Options whose value is one name of a table, checked alike. loss_type and policy_objective are checked together
# by resolve_loss_type; the options of _lazy_choice_tables by their own checks.
OPTION_CHOICES: dict[str, Any] = {
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "kl_estimator": KL_ESTIMATORS,
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS,
    "scale_rewards": REWARD_SCALES,
    "vllm_importance_sampling_mode": IS_CORRECTION_MODES,
    "lr_scheduler_type": LR_SCHEDULER_TYPES,
    "save_strategy": SAVE_STRATEGIES,
    "eval_strategy": EVAL_STRATEGIES,
}


def _lazy_choice_tables() -> dict[str, Any]:
    """The tables kept beside the code that dispatches on them, imported on first use (not with the config)."""
    from grpokit.rewards.contract import ERROR_POLICIES
    from grpokit.rollout.engine import ROLLOUT_ENGINES, engine_names
    from grpokit.rollout.vllm_engine import VLLM_MODES
    from grpokit.tools import TOOL_CALL_FORMATS, TOOLS

    engine_names()  # registers the built-in engines
    return {"reward_error_policy": ERROR_POLICIES, "report_to": TRACKERS, "rollout_engine": ROLLOUT_ENGINES,
            "vllm_mode": VLLM_MODES, "tool_call_format": TOOL_CALL_FORMATS, "tools": TOOLS}


def option_choices(name: str) -> list[str] | None:
    """The valid names of option `name` (None for free-form options), for help text and docs."""
    if name == "loss_type":
        return sorted(set(LOSS_AGGREGATIONS.names()) | set(POLICY_OBJECTIVES.names()))
    if name == "policy_objective":
        return POLICY_OBJECTIVES.names()
    table = OPTION_CHOICES.get(name)
    if table is None:
        table = _lazy_choice_tables().get(name)
    return None if table is None else sorted(table)


def choices_help(name: str) -> str:
    """What `grpo train --help` adds to the option's docstring: its choices, read from their table."""
    choices = option_choices(name)
    if not choices:
        return ""
    text = f" Choices: {', '.join(choices)}."
    if name == "loss_type":
        pairs = ", ".join(f"{objective}: {aggregation}" for objective, aggregation in objective_aggregations().items())
        text += f" A policy objective named here comes with its aggregation ({pairs})."
    return text


def validate(c: GRPOConfig) -> None:
    """Every check, in order; the first failing one raises ConfigError."""
    for name, table in OPTION_CHOICES.items():
        _check_choice(name, getattr(c, name), table)
    _check_choice("reward_error_policy", c.reward_error_policy, _lazy_choice_tables()["reward_error_policy"])
    _raise(report_to_problems(c.report_to))
    _raise(trl_option_problems(c))
    _check_algorithm_options(c)
    _check_rollout_options(c)
    _check_tool_options(c)
    _check_schedule_and_eval(c)
    _check_counts(c)
    _check_optimizer(c)
    _check_sampling(c)
    c.check_geometry(num_processes=1)


_MAPPING_OPTIONS = ("lr_scheduler_kwargs", "generation_kwargs", "model_init_kwargs", "loss_kwargs",
                    "reward_model_kwargs", "gradient_checkpointing_kwargs", "chat_template_kwargs")


def trl_option_problems(c: GRPOConfig) -> list[str]:
    """TRL's options grpokit accepts at their default only, given another value; an accelerator_config that is not
    one; a mapping option given text that is no mapping."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    problems = [p for p in (trl_option_problem(name, getattr(c, name)) for name in AT_DEFAULT_ONLY) if p]
    if not isinstance(c.accelerator_config, AcceleratorConfig):
        keys = ", ".join(f.name for f in dataclasses.fields(AcceleratorConfig))
        problems.append(f"accelerator_config={c.accelerator_config!r} is not an accelerator config: give a mapping of "
                        f"{keys} (e.g. {{'dispatch_batches': False}}), its JSON text, or a JSON file's path.")
    for name in _MAPPING_OPTIONS:
        value = getattr(c, name)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{name}={value!r} must be a mapping of argument: value (JSON text on a command line, "
                            "e.g. '{\"key\": 1}').")
    return problems


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems_message(problems))


def _choices(name: str, value: Any, table: Iterable[str]) -> None:
    if value not in table:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(sorted(table))}.")


def _check_choice(name: str, value: Any, table: Any) -> None:
    """`value` names an entry of `table`: a Registry (which may also take an import path) or a tuple."""
    if not hasattr(table, "resolve"):
        _choices(name, value, table)
        return
    try:
        table.resolve(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _finite(c: GRPOConfig, name: str, low: float | None = None, high: float | None = None,
            low_open: bool = False, hint: str = "") -> None:
    """`name` must be a finite number in [low, high] ((low, high] with low_open); None passes."""
    value = getattr(c, name)
    if value is None:
        return
    ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{name}={value} must be a finite number in {bound}.{hint}")


def _at_least(c: GRPOConfig, name: str, minimum: int = 1) -> None:
    value = getattr(c, name)
    if value is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}.")


def _check_counts(c: GRPOConfig) -> None:
    """Batch geometry, step counts and the learning-rate schedule."""
    if c.num_generations < 2:
        raise ConfigError(
            f"num_generations={c.num_generations}: GRPO compares completions within a group, so it needs at "
            "least 2 per prompt (8 or 16 is typical)."
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "max_completion_length", "logging_steps", "completions_logging_steps", "save_steps",
                 "max_consecutive_nonfinite_steps"):
        _at_least(c, name)
    if c.steps_per_generation is not None and c.generation_batch_size is not None:
        raise ConfigError("Set steps_per_generation or generation_batch_size, not both (one implies the other).")
    for name in ("steps_per_generation", "max_prompt_length", "save_total_limit"):  # None: not set
        _at_least(c, name)
    if c.max_steps == 0 or c.max_steps < -1:
        raise ConfigError(f"max_steps={c.max_steps}: use a positive number of steps, or -1 to use num_train_epochs.")
    _finite(c, "num_train_epochs", 0, low_open=True)
    _finite(c, "learning_rate", 0, hint=" Typical GRPO values: 1e-6 to 1e-5.")
    _check_lr_schedule(c)
    _finite(c, "warmup_ratio", 0, 1)
    if c.warmup_ratio == 1 or c.warmup_steps < 0:
        raise ConfigError(f"warmup_ratio={c.warmup_ratio} must be below 1 and warmup_steps={c.warmup_steps} >= 0.")
    _finite(c, "max_grad_norm", 0, hint=" 0 turns clipping off; 1.0 is usual.")


def _check_optimizer(c: GRPOConfig) -> None:
    """AdamW's options, checked with the rest, before any model loads."""
    _finite(c, "weight_decay", 0)
    _finite(c, "adam_beta1", 0, 1, hint=" 0.9 is usual.")
    _finite(c, "adam_beta2", 0, 1, hint=" 0.999 is usual.")
    for name in ("adam_beta1", "adam_beta2"):
        if getattr(c, name) == 1:
            raise ConfigError(f"{name}=1 must be below 1: the moment estimate would never move from 0.")
    _finite(c, "adam_epsilon", 0, low_open=True, hint=" 1e-8 is usual.")


def _check_sampling(c: GRPOConfig) -> None:
    """Sampling options and reward weights."""
    _finite(c, "temperature", 0, low_open=True, hint=" GRPO samples a group of different completions; for "
            "near-greedy sampling use a small value such as 0.1.")
    if c.temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"temperature={c.temperature} is too close to 0: sampling is then greedy, so the completions of a group "
            "are identical, and the log-probs divide the logits by it, so gradients grow as 1/temperature. GRPO "
            f"needs at least {MIN_TEMPERATURE}; for near-greedy sampling use a small value such as 0.1."
        )
    _finite(c, "top_p", 0, 1, low_open=True)
    if c.top_k < 0:
        raise ConfigError(f"top_k={c.top_k} must be >= 0 (0 disables).")
    _finite(c, "min_p", 0, 1)
    if c.min_p == 1:
        raise ConfigError(f"min_p={c.min_p} must be below 1 (it would drop every token but the likeliest).")
    _finite(c, "repetition_penalty", 0, low_open=True, hint=" 1.0 disables it.")
    if c.reward_weights is not None and any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) for w in c.reward_weights):
        raise ConfigError(f"reward_weights={c.reward_weights} must be a list of finite numbers.")


def _check_schedule_and_eval(c: GRPOConfig) -> None:
    if c.load_best_model_at_end and c.eval_strategy == "no":
        raise ConfigError("load_best_model_at_end=True needs periodic evaluation: set eval_strategy to steps or epoch.")
    for name in ("eval_steps", "per_device_eval_batch_size", "num_generations_eval", "num_completions_to_print"):
        value = getattr(c, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive whole number or null.")


def _check_lr_schedule(c: GRPOConfig) -> None:
    """The schedule's arguments, checked now rather than after the model has loaded (the trainer's get_scheduler
    call stays the judge of anything this does not see)."""
    try:
        problem = schedule_problem(c.lr_scheduler_type, dict(c.lr_scheduler_kwargs), c.learning_rate)
    except TypeError as exc:  # a value of the wrong type inside lr_scheduler_kwargs
        problem = str(exc)
    if problem:
        raise ConfigError(
            f"lr_scheduler_type={c.lr_scheduler_type!r} with lr_scheduler_kwargs={c.lr_scheduler_kwargs}: {problem}"
        )


def schedule_problem(name: str, kwargs: dict[str, Any], learning_rate: float) -> str | None:
    """What transformers' get_scheduler(name, ..., scheduler_specific_kwargs=kwargs) would refuse, found without
    building an optimizer or a schedule: the arguments against the schedule function's signature, then the value
    rules the function checks before it builds anything."""
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    if name in ("constant", "constant_with_warmup"):
        return None  # get_scheduler passes these no lr_scheduler_kwargs
    schedule = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    given = {"num_warmup_steps": 1} if name == "inverse_sqrt" else {"num_warmup_steps": 1, "num_training_steps": 10}
    clash = sorted(set(given) & set(kwargs))
    if clash:
        return f"{schedule.__name__}() got multiple values for keyword argument {clash[0]!r}"
    try:
        bound = inspect.signature(schedule).bind(None, **given, **kwargs)
    except TypeError as exc:
        return f"{schedule.__name__}() {exc}"
    bound.apply_defaults()
    return _schedule_value_problem(bound.arguments, learning_rate)


def _schedule_value_problem(args: dict[str, Any], learning_rate: float) -> str | None:
    """The checks transformers' schedule functions (transformers/optimization.py) make on their arguments before
    they build the schedule, with their messages; found by the arguments a function takes."""
    if "min_lr_rate" in args:
        if args["min_lr"] is not None and args["min_lr_rate"] is not None:
            return "Only one of min_lr or min_lr_rate should be set"
        if args["min_lr"] is None and args["min_lr_rate"] is None:
            return "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`"
    if "lr_end" in args and not learning_rate > args["lr_end"]:
        return f"lr_end ({args['lr_end']}) must be smaller than initial lr ({learning_rate})"
    for name in ("warmup_type", "decay_type"):
        if name in args and args[name] not in ("linear", "cosine", "1-sqrt"):
            return f"Unknown {name.replace('_', ' ')}: {args[name]}, expected 'linear', 'cosine' or '1-sqrt'"
    return None


def _check_algorithm_options(c: GRPOConfig) -> None:
    """Loss, KL, entropy, reference-sync and advantage options, and how they combine."""
    try:
        objective, aggregation = c.resolved_loss
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    entry = POLICY_OBJECTIVES[objective]
    if entry.uses_level is False and c.importance_sampling_level != "token":
        raise ConfigError(
            f"The {objective} objective builds its own sequence weight, so importance_sampling_level="
            f"{c.importance_sampling_level!r} would have no effect; leave it at 'token'."
        )
    if isinstance(entry.uses_level, tuple) and c.importance_sampling_level not in entry.uses_level:
        raise ConfigError(
            f"The {objective} objective needs importance_sampling_level in {list(entry.uses_level)}; "
            f"set importance_sampling_level: {entry.uses_level[0]}."
        )
    if not ADVANTAGE_ESTIMATORS[c.advantage_estimator].uses_scale_rewards and c.scale_rewards != "group":
        raise ConfigError(
            f"advantage_estimator={c.advantage_estimator!r} fixes its own scale (the batch std of the centred "
            f"rewards), so scale_rewards={c.scale_rewards!r} would have no effect; leave scale_rewards at 'group'."
        )
    _finite(c, "epsilon", 0, 1, hint=" The ratio is clipped below at 1 - epsilon.")
    if c.epsilon >= 1 and objective != "gmpo":
        raise ConfigError(f"epsilon={c.epsilon} must be below 1: the ratio is clipped below at 1 - epsilon.")
    _finite(c, "epsilon_high", 0, hint=" DAPO uses 0.28.")
    if c.delta is not None and not (math.isfinite(c.delta) and c.delta > 1 + c.resolved_epsilon_high):
        raise ConfigError(
            f"delta={c.delta} must exceed 1 + epsilon_high = {1 + c.resolved_epsilon_high}, or the cap would "
            "clip inside the trust region; INTELLECT-2 uses 4."
        )
    for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        _finite(c, name, 0, low_open=True)
    for name in ("vespo_k_pos", "vespo_k_neg"):
        _finite(c, name, 0)
    _finite(c, "off_policy_mask_threshold", 0, low_open=True, hint=" DeepSeek-V3.2's delta, e.g. 0.5; null disables.")
    _check_kl_and_entropy(c)


def _check_kl_and_entropy(c: GRPOConfig) -> None:
    _finite(c, "beta", 0, hint=" 0 disables the KL penalty; DeepSeekMath used 0.04.")
    if c.kl_in_reward and c.beta == 0:
        raise ConfigError("kl_in_reward=True needs beta > 0: beta is the coefficient of the KL subtracted from the reward.")
    if c.sync_ref_model and c.beta == 0:
        raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync.")
    _finite(c, "ref_model_mixup_alpha", 0, 1, low_open=True)
    if c.ref_model_sync_steps < 1:
        raise ConfigError(f"ref_model_sync_steps={c.ref_model_sync_steps} must be at least 1.")
    _finite(c, "top_entropy_quantile", 0, 1, hint=" 1.0 keeps every token; the paper recommends 0.2.")
    _finite(c, "entropy_coef", hint=" 0 disables the entropy bonus.")
    _finite(c, "entropy_coef_min", 0)
    _finite(c, "entropy_coef_max", c.entropy_coef_min, hint=" It must be at least entropy_coef_min.")
    _finite(c, "entropy_coef_delta", 0, low_open=True)
    _finite(c, "entropy_target", 0)
    if c.dynamic_sampling_max_rounds < 1:
        raise ConfigError(f"dynamic_sampling_max_rounds={c.dynamic_sampling_max_rounds} must be at least 1.")


def _check_tool_options(c: GRPOConfig) -> None:
    if c.max_tool_calling_iterations is not None and c.max_tool_calling_iterations < 0:
        raise ConfigError(f"max_tool_calling_iterations={c.max_tool_calling_iterations} must be 0 or more (null: "
                          "no limit but max_completion_length).")
    _finite(c, "tool_timeout", 0, low_open=True, hint=" Seconds one tool call may take, e.g. 10.")
    if not isinstance(c.tool_call_format, str):
        if not callable(getattr(c.tool_call_format, "parse", None)):
            raise ConfigError(f"tool_call_format={c.tool_call_format!r} is neither a format name nor an object with "
                              "a parse(text) method.")
    elif ":" not in c.tool_call_format:  # an import path is imported where the format is used
        _check_choice("tool_call_format", c.tool_call_format, _lazy_choice_tables()["tool_call_format"])
    if c.environment_factory is not None and ":" not in c.environment_factory:  # imported when the trainer starts
        raise ConfigError(f"environment_factory={c.environment_factory!r} must be an import path 'pkg.module:factory'.")


def _check_rollout_options(c: GRPOConfig) -> None:
    from grpokit.rollout.engine import engine_names, engine_option_problems

    if ":" not in c.rollout_engine:  # an import path is imported when the trainer starts
        _choices("rollout_engine", c.rollout_engine, engine_names())
    if c.use_vllm and c.rollout_engine not in ("local", "vllm"):
        raise ConfigError(
            f"use_vllm=True and rollout_engine={c.rollout_engine!r} name two different engines; set only one."
        )
    if c.generation_kwargs.get("do_sample", True) is not True:
        raise ConfigError(
            f"generation_kwargs has do_sample={c.generation_kwargs['do_sample']!r}: GRPO learns from differences "
            "between sampled completions, and greedy decoding makes the G completions of a prompt identical. Remove "
            "do_sample (sampling is always on); lower temperature for less random completions."
        )
    if c.generation_kwargs.get("num_beams", 1) != 1:
        raise ConfigError(
            f"generation_kwargs has num_beams={c.generation_kwargs['num_beams']!r}: beam search keeps the likeliest "
            "continuations instead of sampling, so the completions would not be samples of the policy the loss "
            "assumes. Remove num_beams."
        )
    _raise(engine_option_problems(c.resolved_rollout_engine, c))
    _check_mismatch_bounds(c)


def _check_mismatch_bounds(c: GRPOConfig) -> None:
    """The clip bounds of the train/inference mismatch correction (any engine but "local")."""
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    for name, bound in (("clip_min", low), ("clip_max", high)):
        if bound is not None and not (bound > 0 and math.isfinite(bound)):
            raise ConfigError(f"vllm_importance_sampling_{name}={bound} must be a positive finite ratio or null.")
    if low is not None and high is not None and low >= high:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={low} must be less than vllm_importance_sampling_clip_max={high}."
        )
    if c.vllm_importance_sampling_correction and low is None and high is None:
        raise ConfigError(
            "vllm_importance_sampling_correction=True needs at least one of vllm_importance_sampling_clip_min / "
            "_clip_max (TRL's default: clip_max=3.0); or set the correction to False."
        )
