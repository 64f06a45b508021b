"""Registries: each is the one list of the choices of one option (policy objectives, loss aggregations, advantage
estimators, KL estimators, ...). Config validation, `grpo train --help` and docs read the names from here.

A user adds a choice from their own code, without editing grpokit, in either of two ways:

    from grpokit.algorithms import POLICY_OBJECTIVES

    @POLICY_OBJECTIVES.register("my_objective")
    def my_objective(batch, settings):
        ...

or by naming it in the config as an import path, "my_package.my_module:my_objective": the first lookup imports
the module and registers the attribute under that path (so the module must be importable in every process).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator


class Registry:
    """name -> entry (a function, or an object wrapping one), with import-path lookup.

    Args:
        option: the config option whose choices this holds (used in error messages).
        wrap: optional callable turning what a user registers into the stored entry (e.g. adding metadata).
    """

    def __init__(self, option: str, wrap: Callable[..., Any] | None = None) -> None:
        self.option = option
        self._wrap = wrap
        self._entries: dict[str, Any] = {}
        self._by_target: dict[int, Any] = {}  # id(registered object) -> its entry, for import-path aliases

    def register(self, name: str, fn: Any = None, **meta: Any):
        """Register `fn` under `name`; without `fn`, return a decorator. `meta` goes to the wrapper (if any)."""

        def add(target: Any) -> Any:
            if not isinstance(name, str) or not name or ":" in name:
                raise ValueError(f"{self.option}: a registered name must be a non-empty string without ':'.")
            entry = self._wrap(target, name=name, **meta) if self._wrap else target
            self._entries[name] = self._by_target[id(target)] = entry
            return target

        return add if fn is None else add(fn)

    def resolve(self, name: str) -> Any:
        """The entry for `name`, importing "pkg.module:attr" paths on first use; ValueError listing the choices."""
        if name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and ":" in name:
            module_name, _, attr = name.partition(":")
            try:
                target = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(
                    f"{self.option}={name!r}: cannot import {attr!r} from module {module_name!r} ({exc}); check that "
                    "the module is importable (on PYTHONPATH) in every training process."
                ) from exc
            if not callable(target):
                raise ValueError(
                    f"{self.option}={name!r} names a {type(target).__name__}, not a function; point it at a function "
                    "with the signature described in docs/algorithms.md section 8."
                )
            entry = self._by_target.get(id(target))  # registered by a decorator at import: keep its metadata
            if entry is None:
                entry = self._wrap(target, name=name) if self._wrap else target
            self._entries[name] = entry
            return entry
        raise ValueError(
            f"{self.option}={name!r} is not valid; choose one of: {', '.join(self.names())}, or give an import "
            "path 'package.module:function' to your own."
        )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Any:
        return self.resolve(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.option!r}: {', '.join(self.names())})"
