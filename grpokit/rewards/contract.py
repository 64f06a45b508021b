"""The reward-function contract: how the trainer calls reward functions and checks what they return.

A reward function is any callable (plain function, `async def` function, or callable object) called as

    f(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state,
      log_extra=log_extra, log_metric=log_metric, **columns)

with every dataset column passed by name; it returns one value per completion. From a trainer, log_extra(column,
values) adds a column (one value per completion) to the logged completions, and log_metric(name, value) logs a
number, averaged over the logging window beside the trainer's own metrics (both no-ops outside a trainer). This is the signature of Hugging
Face TRL's GRPOTrainer reward functions, so functions written for TRL work unchanged (they must accept **kwargs).
A function is one of two kinds, told apart by what it returns in a batch:

- an outcome reward: every value is a real number, or None when the reward does not apply to that sample
  (kept as NaN, never read as 0);
- a process (step) reward: every value is a list or tuple of (end_offset, reward) pairs, or None (the same as an
  empty list: no steps). end_offset is an int, the exclusive character end of a step in the completion text
  (grpokit.rewards.text.completion_text of the completion), with 0 < end_offset <= len(text) and the offsets
  strictly increasing; reward is a finite real number. See grpokit.rewards.steps and
  grpokit.algorithms.process for how steps become per-token advantages.

The kind is set by the first value that is not None; a later value of the other kind is an invalid value.

`score_completions` calls every function once for the whole batch: synchronous ones one after another, in
order, then the asynchronous ones concurrently (asyncio.gather). The result holds an [N, F] float32 tensor of
outcome rewards (a process function's column is all NaN) and, per function, its validated step lists.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from grpokit.registry import Registry
from grpokit.rewards.text import completion_text, excerpt

logger = logging.getLogger("grpokit.rewards")

# The largest reward magnitude accepted: rewards are float32 tensors, and the group statistics (computed in
# float64) stay exact far beyond it; 1e30 leaves float32's 3.4e38 a margin for weighted sums of several functions.
REWARD_LIMIT = 1e30
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
_RETURN_HINT = "return a list with one float per completion (None where the reward does not apply)"
_STEPS_HINT = (
    "return one list of (end_offset, reward) pairs per completion, end_offset an int character offset in "
    "1..len(completion text), strictly increasing, reward a finite number (None or [] where no step applies)"
)
_MIXED_HINT = f"{_RETURN_HINT}; or, for a process reward, {_STEPS_HINT}; not both kinds in one batch"
_warned_failures: set[str] = set()

StepList = list[tuple[int, float]]


class RewardError(RuntimeError):
    """A reward function could not be resolved, raised, or returned something the trainer cannot use."""


def _stop(name: str, message: str, cause: BaseException | None) -> None:
    raise RewardError(message) from cause


def _count(name: str, message: str, cause: BaseException | None) -> None:
    _warn_once(name, message)


# error_policy (the reward_error_policy option) -> what one failure does: policy(function name, message, exception
# or None) raises, or returns and the failure is counted. The only list of the policies.
ERROR_POLICIES = Registry("reward_error_policy", import_paths=False)
ERROR_POLICIES.register("raise", _stop)
ERROR_POLICIES.register("none", _count)


@dataclass(frozen=True)
class RewardFunction:
    """A reward callable plus the `name` used in metrics (rewards/<name>/mean)."""

    fn: Callable[..., Any]
    name: str

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)


@dataclass(frozen=True)
class RewardScores:
    """Scores of one batch.

    rewards: (N, F) float32, one column per function in the order given, NaN where a function returned None or
        (under error_policy="none") failed; a process function's column is NaN everywhere.
    failures: per function, how many samples failed under error_policy="none" (all zeros under "raise").
    steps: per function, None for an outcome function (and for one whose kind this batch does not show: it
        raised, or returned only None), else N entries, each None or a list of (end_offset: int, reward: float)
        pairs, offsets strictly increasing in 1..len(completion text). A None entry means no steps.
    """

    rewards: torch.Tensor  # (N, F)
    failures: list[int]
    steps: list[list[StepList | None] | None] = field(default_factory=list)  # F entries


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


def _coerce(value: Any, nonfinite_hint: str = "return None for 'does not apply'") -> tuple[float, str | None]:
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
        return math.nan, f"{number} is not finite ({nonfinite_hint})"
    if abs(number) > REWARD_LIMIT:
        return math.nan, (f"{number:g} is beyond +-{REWARD_LIMIT:g}, where the trainer's float32 reward math would "
                          "overflow (scale the reward down: advantages do not depend on its scale)")
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


def _brief(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}..."


def _is_step_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _coerce_steps(value: Any, text: str) -> tuple[StepList | None, str | None]:
    """One returned step list -> (pairs, None), or (None, what is wrong with it). None -> (None, None)."""
    if value is None:
        return None, None
    pairs: StepList = []
    for k, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            return None, f"step {k} is {_brief(pair)}, not an (end_offset, reward) pair"
        offset, reward = pair
        if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, numbers.Integral):
            shown = f"{_brief(offset)} of type {type(offset).__name__}"
            return None, f"step {k} has end offset {shown}, not an int"
        if not 0 < offset <= len(text):
            size = len(text)
            return None, f"step {k} ends at offset {offset}, outside 1..{size} (the completion has {size} characters)"
        if pairs and offset <= pairs[-1][0]:
            before = pairs[-1][0]
            return None, f"step {k} ends at offset {offset}, not after step {k - 1} (offset {before}): offsets increase"
        if reward is None:
            return None, f"step {k} has reward None (leave out a step that has no reward)"
        number, problem = _coerce(reward, nonfinite_hint="leave out a step that has no reward")
        if problem is not None:
            return None, f"step {k} has reward {problem}"
        pairs.append((int(offset), number))
    return pairs, None


def _kind_mismatch(value: Any, is_steps: bool, first: int) -> str:
    """Why `value` does not fit a function whose first non-None value (sample `first`) set its kind."""
    shown = f"{_brief(value)} of type {type(value).__name__}"
    if is_steps:
        what = f"{shown} is not a list of (end_offset, reward) steps, but sample {first} returned a list of steps"
    else:
        what = f"{shown} is a list (of steps?), not a real number, but sample {first} returned a number"
    return f"{what}: one function returns numbers for every sample (an outcome reward) or step lists (a process reward)"


def _values(func: RewardFunction, result: Any, n: int) -> list:
    """The function's return value as a list of n values; RewardError when it is not one (a bug in the function)."""
    values = _as_list(result)
    if values is None or len(values) != n:
        got = f"{len(values)} values" if values is not None else f"a {type(result).__name__}"
        raise RewardError(
            f"reward function {func.name!r} returned {got} for a batch of {n} completions. "
            f"Fix: {_RETURN_HINT}, in the order of `completions`."
        )
    return values


def _validate(
    func: RewardFunction, result: Any, completions: Sequence, policy: str, rows: Sequence[int] | None = None
) -> tuple[list[float], list[StepList | None] | None, int]:
    """Check one function's return value; give its column of floats (all NaN for a process function), its step
    lists (None for an outcome function) and its failure count, or raise."""
    values = _values(func, result, len(completions))
    first = next((i for i, value in enumerate(values) if value is not None), None)
    is_steps = first is not None and _is_step_list(values[first])
    column, steps, failures = [], [], 0
    for index, value in enumerate(values):
        if value is not None and _is_step_list(value) != is_steps:
            parsed, problem, hint = None, _kind_mismatch(value, is_steps, first), _MIXED_HINT
        elif is_steps:
            parsed, problem = _coerce_steps(value, completion_text(completions[index]))
            hint = _STEPS_HINT
        else:
            parsed, problem = _coerce(value)
            hint = _RETURN_HINT
        if problem is not None:
            message = (
                f"reward function {func.name!r} returned an invalid value for sample {index}"
                f"{'' if rows is None else f' (dataset row {rows[index]})'}: {problem}.\n"
                f"  completion: {_completion_excerpt(completions, index)}\n  Fix: {hint}."
            )
            ERROR_POLICIES[policy](func.name, message, None)
            failures += 1
            parsed = None if is_steps else math.nan
        column.append(math.nan if is_steps else parsed)
        steps.append(parsed)
    return column, (steps if is_steps else None), failures


def _raised(
    func: RewardFunction, exc: BaseException, completions: Sequence, policy: str, rows: Sequence[int] | None
) -> tuple[list[float], int]:
    """A function raised: raise RewardError from it, or (policy "none") give a column of NaN, all failed. A
    BaseException that is not an Exception (SystemExit, GeneratorExit, a custom one) stops under every policy: the
    function asked to end the run, which no sample explains."""
    n, shown = len(completions), _exception_text(exc)
    sample = _completion_excerpt(completions, 0)
    scoring = f"  while scoring samples 0..{n - 1}{_rows(rows)}; completion of sample 0: {sample}\n"
    if not isinstance(exc, Exception):
        raise RewardError(
            f"reward function {func.name!r} raised {shown}, which would have ended the trainer\n"
            f"{scoring}  Fix: return a score (or None) for every completion; raise an Exception for a failure."
        ) from exc
    message = (
        f"reward function {func.name!r} raised {shown}\n{scoring}"
        f"  Fix: handle every completion (return None for samples the reward cannot score), or pass "
        f"error_policy=\"none\" to record the batch as failed (NaN) and keep training."
    )
    ERROR_POLICIES[policy](func.name, message, exc)
    return [math.nan] * n, n


def _exception_text(exc: BaseException) -> str:
    """'ValueError: its message', cut to 500 characters; an exception whose str() raises is named by its type."""
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__
        text = "<its str() raised>"
    return f"{type(exc).__name__}: {text[:500]}"


def _rows(rows: Sequence[int] | None, shown: int = 8) -> str:
    """' (dataset rows 4, 4, 9, 9, ...)' for the batch's rows, or '' when they are not known."""
    if rows is None or len(rows) == 0:
        return ""
    more = ", ..." if len(rows) > shown else ""
    return f" (dataset rows {', '.join(str(int(r)) for r in list(rows)[:shown])}{more})"


def _warn_once(name: str, message: str) -> None:
    if name not in _warned_failures:
        _warned_failures.add(name)
        logger.warning("%s\n(further failures of %r are only counted)", message, name)



def _gather(awaitables: list) -> list:
    """Await all concurrently; exceptions come back as values, BaseExceptions too (asyncio would let SystemExit
    end the loop), KeyboardInterrupt excepted. Works inside a running event loop too."""

    async def settle(awaitable: Any) -> Any:
        try:
            return await awaitable
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported with the function's name
            return exc

    async def gather_all() -> list:
        return await asyncio.gather(*map(settle, awaitables))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather_all())
    # Called from inside an event loop (a notebook, an async trainer): run the batch on a loop of its own thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather_all()).result()


def _ignore(*args: Any) -> None:
    """log_extra / log_metric where nothing collects them (scoring outside a trainer)."""


def score_completions(
    funcs: Sequence[RewardFunction],
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence],
    trainer_state: Any,
    error_policy: str = "raise",
    log_extra: Callable[[str, list], None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    rows: Sequence[int] | None = None,
) -> RewardScores:
    """Call every reward function on the batch and stack the results into an (N, F) float32 tensor.

    error_policy "raise": a function that raises, or returns an invalid value (not a finite real number or None;
    for a process function, not a valid step list or None; a value of the other kind than the function's first
    non-None value), stops with a RewardError (the original exception chained). "none": that call's samples (a
    raise) or that sample (a bad value) become NaN (a step list: None) and are counted in `failures`. Returning
    the wrong number of values, or not a list, is always an error: it is a bug in the function, not a property
    of a sample. So is a BaseException that is not an Exception (SystemExit, GeneratorExit, ...): a RewardError
    under every policy, never the end of the trainer; KeyboardInterrupt passes (the user's stop). `rows`: the
    samples' dataset indices, which error messages name.
    """
    if error_policy not in ERROR_POLICIES:
        raise ValueError(f"error_policy must be one of: {', '.join(ERROR_POLICIES)}; got {error_policy!r}")
    funcs = [f if isinstance(f, RewardFunction) else RewardFunction(f, reward_name(f)) for f in funcs]
    n = _check_batch(prompts, completions, completion_ids, columns)
    if n == 0:
        return RewardScores(torch.zeros(0, len(funcs)), [0] * len(funcs), [None] * len(funcs))
    kwargs = dict(columns)
    kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=trainer_state,
                  log_extra=log_extra or _ignore, log_metric=log_metric or _ignore)

    outcomes: list[Any] = [None] * len(funcs)
    pending: dict[int, Any] = {}
    for j, func in enumerate(funcs):
        try:
            outcomes[j] = func(**kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported with the function's name below
            outcomes[j] = exc
            continue
        if inspect.isawaitable(outcomes[j]):
            pending[j] = outcomes[j]
    for j, value in zip(pending, _gather(list(pending.values()))):
        outcomes[j] = value

    columns_out, steps, failures = [], [], []
    for func, outcome in zip(funcs, outcomes):
        if isinstance(outcome, BaseException):
            (column, failed), func_steps = _raised(func, outcome, completions, error_policy, rows), None
        else:
            column, func_steps, failed = _validate(func, outcome, completions, error_policy, rows)
        columns_out.append(column)
        steps.append(func_steps)
        failures.append(failed)
    rewards = torch.tensor(columns_out, dtype=torch.float32).T.reshape(n, len(funcs))  # (N, F)
    return RewardScores(rewards=rewards.contiguous(), failures=failures, steps=steps)
