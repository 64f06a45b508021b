"""The class decorators that make GRPOConfig take TRL's options: `with_trl_fields` adds TRL's options that grpokit
does not define as fields (trl_compat.TRL_FIELDS), `accepts_trl_options` reports every problem of the keywords at
once before the fields' __init__ runs (grpokit/config/trl_compat.py)."""

from __future__ import annotations

import copy
import functools
from dataclasses import field
from typing import Any

from grpokit.config.forms import option_problems
from grpokit.config.trl_compat import TRL_FIELDS
from grpokit.errors import ConfigError, problems_message


def accepts_trl_options(cls: type) -> type:
    """Class decorator over a dataclass: its __init__ first reports every problem of the keywords at once (a
    ConfigError listing each): names that are no option, and TRL options grpokit accepts only at their default
    given another value (grpokit/config/trl_compat.py). functools.wraps keeps the fields' signature for help() and IDEs."""
    fields_init = cls.__init__

    @functools.wraps(fields_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        problems = option_problems(kwargs)
        if problems:
            raise ConfigError(problems_message(problems))
        fields_init(self, *args, **kwargs)

    __init__.__doc__ = "GRPOConfig(**options): every TRL option is accepted where it asks for nothing (trl_compat.py)."
    cls.__init__ = __init__
    return cls


def with_trl_fields(cls: type) -> type:
    """Class decorator under @dataclass: TRL's options that the class does not define (trl_compat.TRL_FIELDS)
    become fields after its own, with TRL's default and the type HfArgumentParser parses them as."""
    for name, (hint, default) in TRL_FIELDS.items():
        cls.__annotations__[name] = hint
        if isinstance(default, (list, dict)):
            setattr(cls, name, field(default_factory=functools.partial(copy.deepcopy, default)))
        else:
            setattr(cls, name, default)
    return cls
