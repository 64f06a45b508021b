"""Registries: each is the one list of the choices of one option (policy objectives, loss aggregations, advantage
estimators, KL estimators, mismatch modes, rollout engines, trackers, ...). Config validation, `grpo train --help`,
the docs and every call site read the names from here.

A user adds a choice from their own code, without editing grpokit, in either of two ways:

    from grpokit.algorithms import POLICY_OBJECTIVES

    @POLICY_OBJECTIVES.register("my_objective")
    def my_objective(batch, settings):
        ...

or, where the registry takes import paths, by naming it in the config as "my_package.my_module:my_objective": the
first lookup imports it (grpokit.imports.import_path; so the module must be importable in every process). An
attribute that a decorator registered keeps the metadata it was registered with.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from grpokit.imports import import_callable, is_import_path

SIGNATURE_DOC = "a function with the signature described in docs/algorithms.md section 8"


class Registry:
    """name -> entry (a function, or an object wrapping one or carrying metadata), with import-path lookup.

    Args:
        option: the config option whose choices this holds (used in error messages).
        wrap: optional callable turning what a user registers into the stored entry (e.g. adding metadata):
            wrap(target, name=name, **meta).
        import_paths: whether "pkg.module:attr" names a choice too (False: only registered names are valid).
        expected: what an import path must name, for the error message.
    """

    def __init__(self, option: str, wrap: Callable[..., Any] | None = None, *, import_paths: bool = True,
                 expected: str = SIGNATURE_DOC) -> None:
        self.option = option
        self.import_paths = import_paths
        self._wrap = wrap
        self._expected = expected
        self._entries: dict[str, Any] = {}
        self._imported: dict[str, Any] = {}  # import path -> entry: found by lookups, never listed as a choice
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
        """The entry for `name`, importing "pkg.module:attr" paths on first use; ValueError listing the choices
        (TypeError when `name` is not a string)."""
        if not isinstance(name, str):
            raise TypeError(f"{self.option}={name!r} should be a string; {self.choices_text()}.")
        if name in self._entries:
            return self._entries[name]
        if self.import_paths and is_import_path(name):
            if name not in self._imported:
                target = import_callable(name, self.option, self._expected)
                entry = self._by_target.get(id(target))  # registered by a decorator at import: keep its metadata
                if entry is None:
                    entry = self._wrap(target, name=name) if self._wrap else target
                self._imported[name] = entry
            return self._imported[name]
        raise ValueError(f"{self.option}={name!r} is not valid; {self.choices_text()}.")

    def choices_text(self) -> str:
        """'choose one of: a, b' (and the import-path form where this registry takes one), for messages."""
        text = f"choose one of: {', '.join(self.names())}"
        return text + ", or give an import path 'package.module:function' to your own" if self.import_paths else text

    def names(self) -> list[str]:
        """The registered names, sorted (import paths that were looked up are not choices)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __getitem__(self, name: str) -> Any:
        return self.resolve(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.option!r}: {', '.join(self.names())})"
