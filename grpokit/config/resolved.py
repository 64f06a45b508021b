"""What GRPOConfig derives from its fields, mixed into it (the fields themselves stay in grpokit/config/fields.py):
the checks run in __post_init__, the resolved values (loss, token budget, epsilon_high, rollout engine, batch
geometry), check_geometry and from_dict."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from grpokit.algorithms import resolve_loss_type
from grpokit.config.bounds import AUTO_TOKEN_BUDGET, MAX_GENERATION_BATCH
from grpokit.config.checks import validate
from grpokit.config.forms import coerce_option, option_problems, trl_value_form, type_problems
from grpokit.errors import ConfigError, problems_message

if TYPE_CHECKING:
    from grpokit.config.fields import GRPOConfig


class ResolvedOptions:
    """GRPOConfig's methods and derived properties; mixed into GRPOConfig, whose fields they read."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, trl_value_form(f.name, getattr(self, f.name)))
        try:
            validate(self)
        except TypeError as exc:  # a value of the wrong type (from Python) reached a check: name every such option
            problems = type_problems(self)
            if not problems:
                raise
            raise ConfigError(problems_message(problems)) from exc

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_loss(self) -> tuple[str, str]:
        """(policy objective, loss aggregation) named by loss_type and policy_objective."""
        return resolve_loss_type(self.loss_type, self.policy_objective)

    @property
    def resolved_token_budget(self) -> int | None:
        """The token budget in force before the model and the loss are known: token_budget when > 0, None when
        <= 0 (TRL's "disabled"), and unset: the automatic budget where this config allows it (the learner also
        needs a per_sample objective and a linear aggregation: `Learner.token_budget`)."""
        if self.token_budget is not None:
            return self.token_budget if self.token_budget > 0 else None
        if not self.padding_free or self.top_entropy_quantile < 1.0:
            return None
        return max((self.max_prompt_length or 0) + self.max_completion_length, AUTO_TOKEN_BUDGET)

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def resolved_rollout_engine(self) -> str:
        """The engine that generates: "vllm" when use_vllm, else rollout_engine."""
        return "vllm" if self.use_vllm else self.rollout_engine

    def resolved_steps_per_generation(self, num_processes: int = 1) -> int:
        """Micro-batches per generation batch, from steps_per_generation or generation_batch_size."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size // (self.per_device_train_batch_size * num_processes)
        return self.steps_per_generation or self.gradient_accumulation_steps

    def global_generation_batch_size(self, num_processes: int = 1) -> int:
        """Completions per generation on all processes together."""
        return self.per_device_train_batch_size * num_processes * self.resolved_steps_per_generation(num_processes)

    def check_geometry(self, num_processes: int) -> None:
        """Batch checks that depend on the number of processes (run again by the trainer)."""
        per_step = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is not None and self.generation_batch_size % per_step:
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size} must be a multiple of "
                f"per_device_train_batch_size x processes = {per_step}; try {per_step * max(1, round(self.generation_batch_size / per_step))}."
            )
        micro_batches = self.resolved_steps_per_generation(num_processes)
        total = self.global_generation_batch_size(num_processes)
        if total > MAX_GENERATION_BATCH * num_processes:
            raise ConfigError(
                f"The generation batch would hold {total} completions per process (per_device_train_batch_size="
                f"{self.per_device_train_batch_size} x steps_per_generation={micro_batches}); the most is "
                f"{MAX_GENERATION_BATCH}. Lower per_device_train_batch_size, gradient_accumulation_steps or "
                "steps_per_generation."
            )
        if total % self.num_generations:
            raise ConfigError(
                f"The generation batch holds {total} completions (per_device_train_batch_size="
                f"{self.per_device_train_batch_size} x {num_processes} processes x steps_per_generation="
                f"{micro_batches}), "
                f"which is not divisible by num_generations={self.num_generations}. Make the generation batch a "
                f"multiple of num_generations, e.g. per_device_train_batch_size={self.num_generations}."
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        """Build from a plain dict (YAML, command line): every unknown key and badly typed value is reported at
        once; TRL options grpokit does not implement are accepted where they ask for nothing (trl_compat.py)."""
        known = {f.name for f in dataclasses.fields(cls)}
        coerced, problems = {}, []
        for key, value in values.items():
            if key not in known:
                continue
            try:
                coerced[key] = coerce_option(key, value)
            except ConfigError as exc:
                problems.append(str(exc))
        problems += option_problems({key: coerced.get(key, value) for key, value in values.items()})
        if problems:
            raise ConfigError(problems_message(problems))
        return cls(**coerced)
