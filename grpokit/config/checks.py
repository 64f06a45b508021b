"""The checks: every rule an option's value must follow, run by GRPOConfig.__post_init__ before any model loads.
Each message says what is wrong and how to fix it.

Choices come from the one table of each (a Registry, or a tuple of transformers' names): OPTION_CHOICES here, and
the tables that live with the code that dispatches on them (reward error policies, trackers, rollout engines, vLLM
modes, tool-call formats, tools). An engine's own options are checked by the engine (the check_options it was
registered with, grpokit.rollout.engine); report_to by grpokit.observe.trackers.report_to_problems.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import types
import typing
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
from grpokit.observe.trackers import TRACKERS, report_to_problems
from grpokit.config.trl_compat import AT_DEFAULT_ONLY, IMPLEMENTED, trl_option_problem

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


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric option accepts, declared with its field in fields.py as `Annotated[int, Range(1, 8)]`:
    from low to high, each end included unless low_open / high_open; None: no bound on that side (the value must
    still be finite); `also`: single values accepted besides (max_steps' -1). `hint` ends the message. The field's
    type says int or float: an int option refuses every float, a float option takes ints; neither takes a bool."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()
    hint: str = ""

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return (isinstance(value, numbers.Integral) or math.isfinite(value)) and above and below

    def __str__(self) -> str:
        low = "-inf" if self.low is None else _number(self.low)
        high = "inf" if self.high is None else _number(self.high)
        span = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high_open else ']'}"
        return " or ".join([*(_number(v) for v in self.also), span])

    def describe(self, kind: type) -> str:
        """'an integer in [1, 8]', '-1 or an integer in [1, 8]', 'a finite number in (0, 1]'."""
        what = "an integer" if kind is int else "a finite number"
        return " or ".join([*(_number(v) for v in self.also), f"{what} in {Range(*dataclasses.astuple(self)[:4])}"])


def _number(value: float) -> str:
    """1e-06 -> '1e-06', 65536 -> '65536', 1.0 -> '1'."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else repr(value)


@dataclasses.dataclass(frozen=True)
class NumericField:
    """A numeric option as declared: int or float, whether None is accepted, whether other types are (a str, as
    pad_to_multiple_of's "auto"), and its Range (None: any finite value)."""

    kind: type
    optional: bool
    others: tuple[type, ...]
    bounds: Range | None


@functools.lru_cache(maxsize=1)
def numeric_fields() -> dict[str, NumericField]:
    """Every GRPOConfig option whose declared type includes int or float, read from the annotations (TRL options
    accepted at their default only are left to trl_option_problem)."""
    from grpokit.config.fields import GRPOConfig  # the fields import this module

    hints, found = typing.get_type_hints(GRPOConfig, include_extras=True), {}
    for name, hint in ((f.name, hints[f.name]) for f in dataclasses.fields(GRPOConfig)):
        bounds = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)), None)
        if typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kind = int if int in args else float if float in args else None
        if kind is not None and name not in AT_DEFAULT_ONLY:
            others = tuple(a for a in args if a not in (int, float, type(None)))
            found[name] = NumericField(kind, type(None) in args, others, bounds)
    return found


def number_problem(name: str, value: Any, spec: NumericField) -> str | None:
    """Why `value` cannot be option `name`'s (a message naming the option and its range), or None."""
    if (value is None and spec.optional) or (not isinstance(value, bool) and isinstance(value, spec.others)):
        return None
    bounds = spec.bounds or Range()
    number = numbers.Integral if spec.kind is int else numbers.Real
    if not isinstance(value, bool) and isinstance(value, number) and value in bounds:
        return None
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:20] + "..."
    hint = bounds.hint and " " + bounds.hint
    return f"{name}={shown} must be {bounds.describe(spec.kind)}{' (or null)' if spec.optional else ''}.{hint}"


def numeric_problems(c: Any) -> list[str]:
    """A message for each numeric option whose value is not a number of its type within its Range."""
    problems = (number_problem(name, getattr(c, name), spec) for name, spec in numeric_fields().items())
    return [p for p in problems if p]


def range_help(name: str) -> str:
    """' Range: [1, 65536].' for a numeric option with a declared Range (`grpo train --help`)."""
    spec = numeric_fields().get(name)
    if spec is None or spec.bounds is None:
        return ""
    return f" Range: {spec.bounds}{' or null' if spec.optional else ''}."

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
    from grpokit.tools.toolbox import TOOL_ISOLATIONS

    engine_names()  # registers the built-in engines
    return {"reward_error_policy": ERROR_POLICIES, "report_to": TRACKERS, "rollout_engine": ROLLOUT_ENGINES,
            "vllm_mode": VLLM_MODES, "tool_call_format": TOOL_CALL_FORMATS, "tools": TOOLS,
            "tool_isolation": TOOL_ISOLATIONS}


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
    """What `grpo train --help` adds to the option's docstring: its choices, read from their table, or the Range
    declared with a numeric option."""
    choices = option_choices(name)
    if not choices:
        return range_help(name)
    text = f" Choices: {', '.join(choices)}."
    if name == "loss_type":
        pairs = ", ".join(f"{objective}: {aggregation}" for objective, aggregation in objective_aggregations().items())
        text += f" A policy objective named here comes with its aggregation ({pairs})."
    return text


def validate(c: GRPOConfig) -> None:
    """Every check; one ConfigError lists every problem found. The checks of how options combine run only when
    every option is a number of its type in its Range and a valid choice (they would misread such a value)."""
    problems = numeric_problems(c) + _problem(_check_loss_names, c)
    lazy = _lazy_choice_tables()
    for name, table in {**OPTION_CHOICES, **{k: lazy[k] for k in ("reward_error_policy", "tool_isolation")}}.items():
        problems += _problem(_check_choice, name, getattr(c, name), table)
    problems += report_to_problems(c.report_to) + trl_option_problems(c)
    _raise(problems)
    for check in (_check_algorithm_options, _check_rollout_options, _check_tool_options, _check_schedule_and_eval,
                  _check_counts, _check_sampling, _check_geometry):
        problems += _problem(check, c)
    _raise(problems)


def _problem(check: Any, *args: Any) -> list[str]:
    """The problems of the ConfigError check(*args) raises (one, or each of a problems_message), or []."""
    try:
        check(*args)
    except ConfigError as exc:
        heading, *lines = str(exc).splitlines() or [""]
        if heading.endswith(" problems in the options:") and all(line.startswith("  - ") for line in lines):
            return [line[4:] for line in lines]
        return [str(exc)]
    return []


def _check_loss_names(c: GRPOConfig) -> None:
    try:
        c.resolved_loss
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _check_geometry(c: GRPOConfig) -> None:
    c.check_geometry(num_processes=1)


_MAPPING_OPTIONS = ("lr_scheduler_kwargs", "generation_kwargs", "model_init_kwargs", "loss_kwargs",
                    "reward_model_kwargs", "gradient_checkpointing_kwargs", "chat_template_kwargs")


def trl_option_problems(c: GRPOConfig) -> list[str]:
    """TRL's options grpokit accepts at their default only, given another value; fsdp / fsdp_config values FSDP2
    cannot run; an accelerator_config that is not one; a mapping option given text that is no mapping."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    judged = (*AT_DEFAULT_ONLY, *IMPLEMENTED)
    problems = [p for p in (trl_option_problem(name, getattr(c, name)) for name in judged) if p]
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


def _check_counts(c: GRPOConfig) -> None:
    """How the batch and schedule options combine (each one's range is its Range)."""
    if c.steps_per_generation is not None and c.generation_batch_size is not None:
        raise ConfigError("Set steps_per_generation or generation_batch_size, not both (one implies the other).")
    _check_lr_schedule(c)


def _check_sampling(c: GRPOConfig) -> None:
    """Reward weights (each sampling option's range is its Range)."""
    if c.reward_weights is not None and any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) for w in c.reward_weights):
        raise ConfigError(f"reward_weights={c.reward_weights} must be a list of finite numbers.")


def _check_schedule_and_eval(c: GRPOConfig) -> None:
    if c.load_best_model_at_end and c.eval_strategy == "no":
        raise ConfigError("load_best_model_at_end=True needs periodic evaluation: set eval_strategy to steps or epoch.")


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
    objective, aggregation = c.resolved_loss
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
    if c.epsilon >= 1 and objective != "gmpo":
        raise ConfigError(f"epsilon={c.epsilon} must be below 1: the ratio is clipped below at 1 - epsilon.")
    if c.delta is not None and not c.delta > 1 + c.resolved_epsilon_high:
        raise ConfigError(
            f"delta={c.delta} must exceed 1 + epsilon_high = {1 + c.resolved_epsilon_high}, or the cap would "
            "clip inside the trust region; INTELLECT-2 uses 4."
        )
    _check_kl_and_entropy(c)


def _check_kl_and_entropy(c: GRPOConfig) -> None:
    if c.kl_in_reward and c.beta == 0:
        raise ConfigError("kl_in_reward=True needs beta > 0: beta is the coefficient of the KL subtracted from the reward.")
    if c.sync_ref_model and c.beta == 0:
        raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync.")
    if c.entropy_coef_max < c.entropy_coef_min:
        raise ConfigError(f"entropy_coef_max={c.entropy_coef_max} must be at least entropy_coef_min="
                          f"{c.entropy_coef_min}.")


def _check_tool_options(c: GRPOConfig) -> None:
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
    _check_async(c)
    _check_token_budget(c)


def _check_token_budget(c: GRPOConfig) -> None:
    """token_budget regroups packed samples: it needs padding_free, room for the longest sample, and a loss whose
    aggregation does not depend on the grouping."""
    if c.token_budget is None or c.token_budget <= 0:  # unset: automatic, only where exact
        return
    if not c.padding_free:
        raise ConfigError(f"token_budget={c.token_budget} packs samples into forwards: it needs padding_free=True "
                          "(or token_budget=0 for one padded forward per micro-batch).")
    prompt = c.max_prompt_length or 1
    if c.token_budget < prompt + c.max_completion_length:
        raise ConfigError(
            f"token_budget={c.token_budget} is smaller than one sample can be (max_prompt_length "
            f"{c.max_prompt_length} + max_completion_length {c.max_completion_length}): a sample "
            f"never splits across forwards. Set token_budget to at least {prompt + c.max_completion_length}.")
    if c.top_entropy_quantile < 1.0:
        raise ConfigError(
            f"top_entropy_quantile={c.top_entropy_quantile} with token_budget: the entropy threshold is a quantile "
            "over a micro-batch's tokens, which a token-budgeted forward does not hold together. Leave token_budget "
            "unset (then there is no budget) or top_entropy_quantile at 1.0.")


def _check_async(c: GRPOConfig) -> None:
    """The asynchronous-only options mean something only when generation runs ahead (max_staleness >= 1); FSDP's
    refusal is in fsdp.run_options."""
    for name in ("weight_sync_steps", "queue_maxsize", "heartbeat_stale_after_s"):
        default = type(c).__dataclass_fields__[name].default
        if c.max_staleness == 0 and getattr(c, name) != default:
            raise ConfigError(
                f"{name}={getattr(c, name)} applies to asynchronous rollouts only: set max_staleness >= 1 (generate "
                f"ahead with weights at most that many versions old), or leave {name} at {default}."
            )
    if c.max_inflight_tasks == 0:
        raise ConfigError("max_inflight_tasks=0 sends no completion to the engine: give the completions per engine "
                          "call (a positive number), or -1 for a whole generation batch at once.")
    if c.max_staleness > 0 and c.fsdp:
        raise ConfigError(
            "max_staleness > 0 (asynchronous rollouts) with fsdp is not supported yet: train asynchronously with "
            "DDP (no fsdp option), or synchronously (max_staleness=0) with FSDP."
        )


def _check_mismatch_bounds(c: GRPOConfig) -> None:
    """The clip bounds of the train/inference mismatch correction (any engine but "local")."""
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={low} must be less than vllm_importance_sampling_clip_max={high}."
        )
    if c.vllm_importance_sampling_correction and low is None and high is None:
        raise ConfigError(
            "vllm_importance_sampling_correction=True needs at least one of vllm_importance_sampling_clip_min / "
            "_clip_max (TRL's default: clip_max=3.0); or set the correction to False."
        )
