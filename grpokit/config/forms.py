"""Option forms: the values an option may be written as, before the checks see them.

- TRL's value forms (`trl_value_form`): report_to as a string, "none" or "all"; scale_rewards True/False; a number
  written as a string ("1e-5", which YAML reads as a string) for a float option; None for a dict option.
- Command-line and YAML values (`coerce_option`): a string parsed as a YAML scalar where the field's type is not
  a string, then checked against the field's annotation (the hand-written type check below: the annotations are
  few and simple, and the messages name the option and the type it needs).
- Keys (`option_problems`): a key that is neither a field nor a TRL option accepted here is reported with the
  nearest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml

from grpokit.errors import ConfigError
from grpokit.trackers import TRACKERS, tracker_installed
from grpokit.trl_compat import is_trl_option, script_key_advice, trl_option_problem

_UNION_TYPES = (typing.Union, types.UnionType)
_DICT_OPTIONS = ("lr_scheduler_kwargs", "generation_kwargs", "model_init_kwargs", "loss_kwargs", "reward_model_kwargs")


@lru_cache(maxsize=1)
def _type_hints() -> dict[str, Any]:
    from grpokit.config.fields import GRPOConfig  # the fields import this module

    return typing.get_type_hints(GRPOConfig)


def _field_type(name: str) -> Any:
    return _type_hints()[name]


def field_names() -> frozenset[str]:
    return frozenset(_type_hints())


def coerce_option(name: str, value: Any) -> Any:
    """Check `value` against the field's annotation; command-line strings are parsed as YAML scalars first."""
    hint = _field_type(name)
    if isinstance(value, str) and not _matches(value, hint):  # "no" stays "no" where a string is valid
        parsed = yaml.safe_load(value) if value != "" else None
        value = parsed if parsed is not None or _allows_none(hint) else value
    value = trl_value_form(name, value)
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
    a number written as a string ("1e-5", which YAML reads as a string) for a float option."""
    if name == "report_to":
        return _report_to_list(value)
    if name == "tools" and isinstance(value, str):  # --tools calculator,pkg.mod:fn
        return [v.strip() for v in value.split(",") if v.strip()]
    if value is None and name in _DICT_OPTIONS:  # TRL's default for these is None
        return {}
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if name == "scale_rewards" and isinstance(value, str) and value.lower() in ("true", "false"):
        return "group" if value.lower() == "true" else "none"
    if isinstance(value, str) and _takes_float(name):
        try:
            return float(value)
        except ValueError:
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
    """A message for each key of `values` that is neither a GRPOConfig field nor a TRL option accepted here."""
    known = field_names()
    problems = []
    for key, value in values.items():
        if key in known:
            continue
        if is_trl_option(key):
            problem = trl_option_problem(key, value)
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
