"""ConfigError, the error of an option whose value cannot work, and how several of them are reported at once.

It lives apart from grpokit.config so that the light modules that check values (grpokit.imports, the registries)
can raise it without importing the config.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and how to fix it."""


def problems_message(problems: list[str]) -> str:
    """One problem as it is; several as a numbered heading and one line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the options:\n" + "\n".join(f"  - {p}" for p in problems)
