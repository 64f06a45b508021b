"""Option forms: the values an option may be written as, before the checks see them.

- TRL's value forms (`trl_value_form`): report_to as a string, "none" or "all"; scale_rewards True/False; a number
  written as a string ("1e-5", which YAML reads as a string) for a float option; None for a dict option.
- Command-line and YAML values (`coerce_option`): a string parsed as a YAML scalar where the field's type is not
  a string, then checked against the type its value must have (the hand-written type check below: the types are
  few and simple, and the messages name the option and the type it needs). That type is the field's annotation,
  except where the annotation is the form HfArgumentParser parses (VALUE_TYPES), and for TRL's options accepted
  at their default only, whose one check is that (option_problems, grpokit/config/trl_compat.py).
- A mapping option written as text (JSON or YAML, as a command line gives it) is read as the mapping;
  accelerator_config becomes transformers' AcceleratorConfig, as TrainingArguments makes it.
- Keys (`option_problems`): a key that is neither a field nor a TRL option accepted here is reported with the
  nearest valid name; a TRL option grpokit accepts only at its default, given another value, says what to use.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml

from grpokit.errors import ConfigError
from grpokit.observe.trackers import TRACKERS, tracker_installed
from grpokit.config.trl_compat import AT_DEFAULT_ONLY, is_trl_option, script_key_advice, trl_option_problem

_UNION_TYPES = (typing.Union, types.UnionType)
_DICT_OPTIONS = ("lr_scheduler_kwargs", "generation_kwargs", "model_init_kwargs", "loss_kwargs", "reward_model_kwargs")
_OPTIONAL_DICT_OPTIONS = ("gradient_checkpointing_kwargs", "chat_template_kwargs")
# The type a value must have once read, where the annotation is the form HfArgumentParser parses instead
VALUE_TYPES: dict[str, Any] = {
    **dict.fromkeys(_DICT_OPTIONS, dict[str, Any]),
    **dict.fromkeys(_OPTIONAL_DICT_OPTIONS, dict[str, Any] | None),
    "tools": list[Any],  # names, import paths, or (from Python) the functions
    "tool_call_format": Any,  # a name, an import path, or (from Python) a format object
    "accelerator_config": Any,  # a mapping, JSON text or a JSON file's path: checked by config/checks.py
    "resume_from_checkpoint": str | bool | None,  # what train(resume_from_checkpoint=...) takes
    "include_num_input_tokens_seen": str | bool,
    "debug": str | list[str],
}


@lru_cache(maxsize=1)
def _type_hints() -> dict[str, Any]:
    from grpokit.config.fields import GRPOConfig  # the fields import this module

    return typing.get_type_hints(GRPOConfig)


def _field_type(name: str) -> Any:
    """The type option `name`'s value must have (AT_DEFAULT_ONLY options, and the fields a subclass adds, as
    open-r1's GRPOConfig does: any; trl_option_problem and the subclass judge them)."""
    if name in AT_DEFAULT_ONLY:
        return Any
    return VALUE_TYPES.get(name) or _type_hints().get(name, Any)


def field_names() -> frozenset[str]:
    return frozenset(_type_hints())


def coerce_option(name: str, value: Any) -> Any:
    """Check `value` against the field's annotation; command-line strings are parsed as YAML scalars first."""
    hint = _field_type(name)
    if isinstance(value, str) and not _matches(value, hint):  # "no" stays "no" where a string is valid
        parsed = yaml.safe_load(value) if value != "" else None
        value = parsed if parsed is not None or _allows_none(hint) else value
    value = trl_value_form(name, value)
    if name in AT_DEFAULT_ONLY:  # --fp16 true; the value is judged with the other options (option_problems)
        value = yaml.safe_load(value) if isinstance(value, str) and value else value
    if not _matches(value, hint):
        raise ConfigError(f"{name}={value!r} should be {_describe(hint)}.")
    if _takes_float(name) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def _report_to_list(value: Any) -> Any:
    """report_to in any of TRL's forms -> a list of tracker names (other objects are left for the checks)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        return value
    if value in (["none"], ["no"]):
        return []
    if "all" in value:
        installed = [name for name in TRACKERS if tracker_installed(name)]
        return installed + [v for v in value if v != "all" and v not in TRACKERS]
    return value


def trl_value_form(name: str, value: Any) -> Any:
    """TRL's value forms -> grpokit's: report_to as a string, "none" or "all"; scale_rewards True/False;
    a number written as a string ("1e-5", which YAML reads as a string) or an int for a float option."""
    if name == "report_to":
        return _report_to_list(value)
    if name == "tools" and isinstance(value, str):  # --tools calculator,pkg.mod:fn
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, str) and name in _DICT_OPTIONS + _OPTIONAL_DICT_OPTIONS:  # JSON text (a command line)
        value = _mapping_text(value)
    if value is None and name in _DICT_OPTIONS:  # TRL's default for these is None
        return {}
    if name == "accelerator_config":
        return _accelerator_config(value)
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if name == "scale_rewards" and isinstance(value, str) and value.lower() in ("true", "false"):
        return "group" if value.lower() == "true" else "none"
    if isinstance(value, (str, numbers.Integral)) and not isinstance(value, bool) and _takes_float(name):
        try:  # an int for a float option too: torch's AdamW refuses betas=(0, 0.999)
            return float(value)
        except (ValueError, OverflowError):  # left for the checks to report
            return value
    return value


def _mapping_text(text: str) -> Any:
    """'{"min_lr_rate": 0.1}' (JSON, or a YAML flow mapping) -> the dict; other text is left for the checks."""
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return parsed if isinstance(parsed, dict) else text


def _accelerator_config(value: Any) -> Any:
    """TrainingArguments' forms of accelerator_config (None, a mapping, JSON text, a JSON file's path) ->
    transformers' AcceleratorConfig; a value that is none of these is left for the checks to report."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    if isinstance(value, str):
        value = _mapping_text(value) if value.lstrip().startswith("{") else value
        if isinstance(value, str) and Path(value).is_file():
            return AcceleratorConfig.from_json_file(value)
    if value is None:
        return AcceleratorConfig()
    if isinstance(value, dict):
        try:
            return AcceleratorConfig(**value)
        except TypeError:
            return value
    return value


def _takes_float(name: str) -> bool:
    hint = _field_type(name)
    return hint is float or (typing.get_origin(hint) in _UNION_TYPES and float in typing.get_args(hint))


def _allows_none(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in _UNION_TYPES:
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in _UNION_TYPES:
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint)).replace("NoneType", "null")


def type_problems(config: Any) -> list[str]:
    """A message for each field whose value does not have the field's type (e.g. num_generations="3")."""
    return [
        f"{f.name}={getattr(config, f.name)!r} should be {_describe(_field_type(f.name))}."
        for f in dataclasses.fields(config) if not _matches(getattr(config, f.name), _field_type(f.name))
    ]


def option_problems(values: dict[str, Any]) -> list[str]:
    """A message for each key of `values` that is no GRPOConfig option, and each TRL option given a value grpokit
    does not accept (trl_compat.py)."""
    known = field_names()
    problems = []
    for key, value in values.items():
        if is_trl_option(key):
            problem = trl_option_problem(key, value)
        elif key in known:
            continue
        else:
            problem = f"Unknown option {key!r}.{script_key_advice(key) or _did_you_mean(key, known)}"
        if problem:
            problems.append(problem)
    return problems


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else " See `grpo train --help` for the valid options."


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file of option: value (and the run keys of `grpo train`), as a dict; ConfigError when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist.")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option: value, not a {type(data).__name__}.")
    return data
