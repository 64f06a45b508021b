"""Import paths: "package.module:attribute" names an object in the user's own code wherever an option takes one
(a policy objective, an advantage estimator, a mismatch mode, a rollout engine, a reward function, a tool-call
format, an environment factory). This is the one resolver they all use:

    import_path("my_package.rewards:score", "reward_funcs")      # -> the function
    import_path("my_package.rewards:Judge.score", "reward_funcs")  # the attribute may be dotted

A failure is an ImportPathError (a ConfigError, so a ValueError) whose message names the option, the module or
attribute that failed, and the fix. The module must be importable in every training process.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from grpokit.errors import ConfigError

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ImportPathError(ConfigError):
    """An import path that does not lead to a usable object; the message names the option and how to fix it."""


def is_import_path(text: Any) -> bool:
    """Whether `text` has the form "package.module:attribute" (attribute possibly dotted)."""
    return isinstance(text, str) and _IMPORT_PATH.match(text) is not None


def import_path(path: str, option: str) -> Any:
    """The object that "package.module:attribute" names; `option` is the config option (or argument) that gave it."""
    if not is_import_path(path):
        raise ImportPathError(f"{option}={path!r} is not an import path; write it as 'package.module:attribute'.")
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportPathError(
            f"{option}={path!r}: could not import module {module_name!r} ({exc}). Check that the module is installed "
            "or on sys.path in every training process (run from the folder that contains it, add that folder to "
            "PYTHONPATH, or pip install it)."
        ) from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n, None)))
            raise ImportPathError(
                f"{option}={path!r}: {getattr(target, '__name__', module_name)!r} has no attribute {part!r}; "
                f"callables there: {public[:20]}"
            )
        target = getattr(target, part)
    return target


def import_callable(path: str, option: str, expected: str = "a function") -> Any:
    """import_path for options that need something to call; `expected` says what, for the message."""
    target = import_path(path, option)
    if not callable(target):
        raise ImportPathError(
            f"{option}={path!r} names a {type(target).__name__}, not a callable; point it at {expected}."
        )
    return target
