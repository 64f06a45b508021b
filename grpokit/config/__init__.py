"""GRPOConfig: every training option, documented once by the docstring under its field.

    fields.py  the GRPOConfig dataclass: the fields with their docstrings (field_docs, `grpo train --help`)
    checks.py  the checks of the values, run in __post_init__ before any model loads; the tables of choices
    forms.py   the forms values may be written in: TRL's, YAML's and the command line's; unknown keys

Everything is importable from here, as before the split.
"""

from typing import Any

from grpokit.config.checks import (
    EVAL_STRATEGIES,
    LR_SCHEDULER_TYPES,
    MIN_TEMPERATURE,
    OPTION_CHOICES,
    SAVE_STRATEGIES,
    choices_help,
    option_choices,
    schedule_problem,
    validate,
)
from grpokit.config.fields import GRPOConfig, accepts_trl_options, field_docs
from grpokit.config.forms import coerce_option, load_yaml, option_problems, trl_value_form, type_problems
from grpokit.errors import ConfigError, problems_message
from grpokit.observe.trackers import TRACKERS, tracker_installed

# The older names of the tracker registry (grpokit.observe.trackers.TRACKERS), the only list of report_to's names.
REPORT_SINKS = TRACKER_PACKAGES = TRACKERS


def __getattr__(name: str) -> Any:
    if name == "REWARD_ERROR_POLICIES":  # kept with the reward contract, which imports more than the config needs
        from grpokit.rewards.contract import ERROR_POLICIES

        return ERROR_POLICIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EVAL_STRATEGIES",
    "LR_SCHEDULER_TYPES",
    "MIN_TEMPERATURE",
    "OPTION_CHOICES",
    "REPORT_SINKS",
    "REWARD_ERROR_POLICIES",
    "SAVE_STRATEGIES",
    "TRACKERS",
    "TRACKER_PACKAGES",
    "ConfigError",
    "GRPOConfig",
    "accepts_trl_options",
    "choices_help",
    "coerce_option",
    "field_docs",
    "load_yaml",
    "option_choices",
    "option_problems",
    "problems_message",
    "schedule_problem",
    "tracker_installed",
    "trl_value_form",
    "type_problems",
    "validate",
]
