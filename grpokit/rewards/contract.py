"""The reward-function contract: how the trainer calls reward functions and checks what they return.

A reward function is any callable (plain function, `async def` function, or callable object) called as

    f(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state, **columns)

with every dataset column passed by name; it returns one value per completion: a real number, or None when the
reward does not apply to that sample (kept as NaN, never read as 0). This is the signature of Hugging Face TRL's
GRPOTrainer reward functions, so functions written for TRL work unchanged (they must accept **kwargs).

`score_completions` calls every function once for the whole batch: synchronous ones one after another, in
order, then the asynchronous ones concurrently (asyncio.gather). The result is an [N, F] float32 tensor.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from grpokit.rewards.text import completion_text, excerpt

logger = logging.getLogger("grpokit.rewards")

ErrorPolicy = Literal["raise", "none"]
ERROR_POLICIES = ("raise", "none")
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
_RETURN_HINT = "return a list with one float per completion (None where the reward does not apply)"
_warned_failures: set[str] = set()


class RewardError(RuntimeError):
    """A reward function could not be resolved, raised, or returned something the trainer cannot use."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward callable plus the `name` used in metrics (rewards/<name>/mean)."""

    fn: Callable[..., Any]
    name: str

    @property
    def is_async(self) -> bool:
        """True for `async def` functions and objects whose __call__ is `async def` (partials unwrapped)."""
        target = self.fn
        while isinstance(target, functools.partial):
            target = target.func
        return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)


@dataclass(frozen=True)
class RewardScores:
    """Scores of one batch.

    rewards: (N, F) float32, NaN where a function returned None or (under error_policy="none") failed.
    names: the F function names, in column order.
    failures: per function, how many samples failed under error_policy="none" (all zeros under "raise").
    """

    rewards: torch.Tensor  # (N, F)
    names: list[str]
    failures: list[int]


def reward_name(fn: Any) -> str:
    """Metric name of a callable: its __name__ (partials unwrapped), else its class name; '<lambda>' -> 'lambda'."""
    if isinstance(fn, RewardFunction):
        return fn.name
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(target).__name__
    return name.strip("<>").replace("/", "_") or "reward"


def unique_names(names: Sequence[str]) -> list[str]:
    """Make names unique by suffixing repeats: ["f", "f", "f"] -> ["f", "f_2", "f_3"]."""
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        out.append(candidate)
    return out


def _check_batch(prompts: Sequence, completions: Sequence, completion_ids: Sequence, columns: Mapping) -> int:
    """Batch size N after checking that every per-sample input has N entries (a trainer bug otherwise)."""
    n = len(completions)
    sizes = {"prompts": len(prompts), "completion_ids": len(completion_ids)}
    sizes.update({f"column {name!r}": len(values) for name, values in columns.items()})
    wrong = {what: size for what, size in sizes.items() if size != n}
    if wrong:
        raise ValueError(
            f"score_completions got {n} completions but {wrong}; every input needs one entry per completion"
        )
    clash = sorted(set(columns) & set(RESERVED_ARGUMENTS))
    if clash:
        raise ValueError(
            f"dataset column(s) {clash} clash with reward-function arguments {list(RESERVED_ARGUMENTS)}; "
            "rename the column(s) in the dataset"
        )
    return n


def _coerce(value: Any) -> tuple[float, str | None]:
    """One returned value -> (float, None), or (nan, what is wrong with it). None -> (nan, None)."""
    if value is None:
        return math.nan, None
    if isinstance(value, torch.Tensor) or isinstance(value, np.ndarray):
        if value.ndim != 0:
            return math.nan, f"a {type(value).__name__} of shape {tuple(value.shape)} is not a single number"
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, complex) or not isinstance(value, numbers.Real):
        return math.nan, f"{excerpt(repr(value), 60)} of type {type(value).__name__} is not a real number"
    number = float(value)
    if not math.isfinite(number):
        return math.nan, f"{number} is not finite (return None for 'does not apply')"
    return number, None


def _as_list(result: Any) -> list | None:
    """The returned values as a list, or None when `result` is not a one-dimensional sequence."""
    if isinstance(result, (list, tuple)):
        return list(result)
    if isinstance(result, (torch.Tensor, np.ndarray)) and result.ndim == 1:
        return list(result)
    return None


def _completion_excerpt(completions: Sequence, index: int) -> str:
    return excerpt(completion_text(completions[index])) if completions else "''"


def _validate(
    func: RewardFunction, result: Any, completions: Sequence, policy: ErrorPolicy
) -> tuple[list[float], int]:
    """Check one function's return value; give its column of floats and its failure count, or raise."""
    n = len(completions)
    values = _as_list(result)
    if values is None or len(values) != n:
        got = f"{len(values)} values" if values is not None else f"a {type(result).__name__}"
        raise RewardError(
            f"reward function {func.name!r} returned {got} for a batch of {n} completions. "
            f"Fix: {_RETURN_HINT}, in the order of `completions`."
        )
    column, failures = [], 0
    for index, value in enumerate(values):
        number, problem = _coerce(value)
        if problem is not None:
            message = (
                f"reward function {func.name!r} returned an invalid value for sample {index}: {problem}.\n"
                f"  completion: {_completion_excerpt(completions, index)}\n  Fix: {_RETURN_HINT}."
            )
            if policy == "raise":
                raise RewardError(message)
            _warn_once(func.name, message)
            failures += 1
        column.append(number)
    return column, failures


def _raised(
    func: RewardFunction, exc: BaseException, completions: Sequence, policy: ErrorPolicy
) -> tuple[list[float], int]:
    """A function raised: raise RewardError from it, or (policy "none") give a column of NaN, all failed."""
    n = len(completions)
    message = (
        f"reward function {func.name!r} raised {type(exc).__name__}: {exc}\n"
        f"  while scoring samples 0..{n - 1}; completion of sample 0: {_completion_excerpt(completions, 0)}\n"
        f"  Fix: handle every completion (return None for samples the reward cannot score), or pass "
        f"error_policy=\"none\" to record the batch as failed (NaN) and keep training."
    )
    if policy == "raise":
        raise RewardError(message) from exc
    _warn_once(func.name, message)
    return [math.nan] * n, n


def _warn_once(name: str, message: str) -> None:
    if name not in _warned_failures:
        _warned_failures.add(name)
        logger.warning("%s\n(further failures of %r are only counted)", message, name)


def _gather(awaitables: list) -> list:
    """Await all concurrently; exceptions come back as values. Works inside a running event loop too."""

    async def gather_all() -> list:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather_all())
    # Called from inside an event loop (a notebook, an async trainer): run the batch on a loop of its own thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather_all()).result()


def score_completions(
    funcs: Sequence[RewardFunction],
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence],
    trainer_state: Any,
    error_policy: ErrorPolicy = "raise",
) -> RewardScores:
    """Call every reward function on the batch and stack the results into an (N, F) float32 tensor.

    error_policy "raise": a function that raises, or returns a value that is not a finite real number or None,
    stops with a RewardError (the original exception chained). "none": that call's samples (a raise) or that
    sample (a bad value) become NaN and are counted in `failures`. Returning the wrong number of values, or not
    a list, is always an error: it is a bug in the function, not a property of a sample.
    """
    if error_policy not in ERROR_POLICIES:
        raise ValueError(f"error_policy must be one of {ERROR_POLICIES}, got {error_policy!r}")
    funcs = [f if isinstance(f, RewardFunction) else RewardFunction(f, reward_name(f)) for f in funcs]
    n = _check_batch(prompts, completions, completion_ids, columns)
    if n == 0:
        return RewardScores(torch.zeros(0, len(funcs)), [f.name for f in funcs], [0] * len(funcs))
    kwargs = dict(columns)
    kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=trainer_state)

    outcomes: list[Any] = [None] * len(funcs)
    pending: dict[int, Any] = {}
    for j, func in enumerate(funcs):
        try:
            outcomes[j] = func(**kwargs)
        except Exception as exc:  # noqa: BLE001 - reported with the function's name below
            outcomes[j] = exc
            continue
        if inspect.isawaitable(outcomes[j]):
            pending[j] = outcomes[j]
    for j, value in zip(pending, _gather(list(pending.values()))):
        outcomes[j] = value

    columns_out, failures = [], []
    for func, outcome in zip(funcs, outcomes):
        if isinstance(outcome, BaseException):
            column, failed = _raised(func, outcome, completions, error_policy)
        else:
            column, failed = _validate(func, outcome, completions, error_policy)
        columns_out.append(column)
        failures.append(failed)
    rewards = torch.tensor(columns_out, dtype=torch.float32).T.reshape(n, len(funcs))  # (N, F)
    return RewardScores(rewards=rewards.contiguous(), names=[f.name for f in funcs], failures=failures)
