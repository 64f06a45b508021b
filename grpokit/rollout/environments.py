"""Environments for multi-turn rollouts: TRL's `environment_factory` contract, plus an optional `respond`.

An environment is any object built by a factory with no arguments:

    class Guess:
        def reset(self, **row) -> str | None:      # required: called with the dataset row's columns before each
            ...                                     # episode; a string is appended to the prompt's last message
        def respond(self, text: str) -> str | None:  # optional (grpokit): after each model turn without tool
            ...                                     # calls; a string is its answer (a user message), None ends
        def get_reward(self) -> float:              # optional: the environment scores the finished episode
            ...
        def probe(self, position: int) -> str:      # every other public method is a tool the model can call
            \"\"\"Look at one position.

            Args:
                position: Which one, from 0.
            \"\"\"

`respond` is gym's `step` under a name that cannot clash with a TRL environment's tool called `step`. Methods run
in the training thread (tool methods too, without tool_timeout), so an environment may hold thread-bound state;
`reset` and `respond` may be coroutine functions.

`environment_factory` is one factory (every row uses it) or a dict {name: factory}, where each row's
`environment` column names its factory (and only that environment's methods are offered as its tools). Instances
are pooled, one per concurrent episode, and reset before every episode, so a factory may be expensive. Reward
functions receive the episodes' instances as `environments=`; an environment with `get_reward` is one more reward
function, named after its class, with weight 1.

A method that raises, or ends with SystemExit, GeneratorExit or any other BaseException, stops training with an
EnvironmentContractError naming the method and the dataset row (KeyboardInterrupt passes: the user's stop).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Mapping, Sequence

CONTROL_METHODS = ("reset", "respond", "get_reward")


class EnvironmentContractError(ValueError):
    """An environment factory or instance breaks the contract (a method raised, SystemExit included); the message
    names the method and, once known, the dataset row. `environment`: the instance whose method raised, if any."""

    environment: Any = None


def environment_tools(environment: Any) -> list[Callable]:
    """An environment's public methods other than reset/respond/get_reward: the tools it offers the model.
    Found on the class, so properties are never evaluated."""
    return [
        getattr(environment, name) for name, member in inspect.getmembers_static(type(environment))
        if not name.startswith("_") and name not in CONTROL_METHODS and inspect.isfunction(member)
    ]


def call_environment(environment: Any, method: str, *args: Any, **kwargs: Any) -> str | None:
    """environment.method(...) awaited if it is a coroutine, its result as text (None stays None); an exception,
    a BaseException such as SystemExit (a method must not end the trainer), or a result that cannot be turned into
    text, becomes an EnvironmentContractError naming the method. KeyboardInterrupt passes: it is the user's stop."""
    return _call(environment, method, args, kwargs, "")


def _call(environment: Any, method: str, args: tuple, kwargs: dict[str, Any], where: str) -> str | None:
    """call_environment, with `where` (" on dataset row 7") added to an error's message."""
    name = f"{type(environment).__name__}.{method}()"
    try:
        result = getattr(environment, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        return None if result is None else str(result)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit, GeneratorExit, ... would end the run without a word
        columns = f" (row columns: {', '.join(kwargs)})" if kwargs else ""
        error = EnvironmentContractError(f"{name} raised {_described(exc)}{where}{columns}")
        error.environment = environment
        raise error from exc


def _described(exc: BaseException) -> str:
    """'ValueError: bad row', or for a BaseException that is not an Exception, what it would have done. Its text
    is cut to 500 characters; one whose str() raises is named by its type."""
    try:
        shown = str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__
        shown = "<its str() raised>"
    text = f"{type(exc).__name__}: {shown[:500]}"
    if isinstance(exc, Exception):
        return text
    return f"{text} (which would have ended the trainer; raise an Exception for a failure)"


def name_row(error: EnvironmentContractError, instances: Sequence[Any], rows: Sequence[int]
             ) -> EnvironmentContractError:
    """The error with the dataset row of the episode whose environment raised it (instances[i] ran rows[i])."""
    index = next((i for i, env in enumerate(instances) if env is getattr(error, "environment", None)), None)
    if index is None:
        return error
    named = EnvironmentContractError(f"{error} on dataset row {rows[index]}")
    named.environment = error.environment
    return named


async def _await(value: Any) -> Any:
    return await value


def _probe(name: str | None, factory: Callable) -> Any:
    label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    if not callable(factory):
        raise EnvironmentContractError(f"{label} must be a callable that returns an environment (e.g. the class itself).")
    try:
        instance = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: named, not a silent end of the run
        raise EnvironmentContractError(f"{label}() raised {_described(exc)}") from exc
    if not callable(getattr(instance, "reset", None)):
        raise EnvironmentContractError(f"{label} built a {type(instance).__name__} without a reset(**row) method; every "
                                "environment needs one (return None, or a string to append to the prompt).")
    return instance


class Environments:
    """Pools of environment instances, one pool per factory name (None for a single factory)."""

    def __init__(self, factory: Callable | Mapping[str, Callable]) -> None:
        self.named = isinstance(factory, Mapping)
        factories = dict(factory) if self.named else {None: factory}
        if not factories:
            raise EnvironmentContractError("environment_factory is an empty dict; give at least one {name: factory}.")
        self.factories = factories
        self.pools = {name: [_probe(name, f)] for name, f in factories.items()}
        self.tools = {name: environment_tools(pool[0]) for name, pool in self.pools.items()}

    def resolve_names(self, values: Sequence[Any]) -> list[str | None]:
        """The factory name of each row from its `environment` value (None throughout for a single factory);
        a value that names no factory is an error."""
        if not self.named:
            return [None] * len(values)
        for name in values:
            if name not in self.factories:
                raise EnvironmentContractError(
                    f"A row has environment={name!r}, which is not one of environment_factory's names "
                    f"({', '.join(map(repr, self.factories))}); every row needs an 'environment' column naming one."
                )
        return list(values)

    def check_rows(self, dataset) -> None:
        """Fail before training when a dict factory meets a dataset without a valid `environment` column."""
        if self.named:
            if "environment" not in dataset.column_names:
                raise EnvironmentContractError("environment_factory is a dict, so the dataset needs an 'environment' "
                                        "column naming each row's environment.")
            self.resolve_names(list(set(dataset["environment"])))

    def reset(self, rows: Sequence[Mapping[str, Any]], indices: Sequence[int] | None = None
              ) -> tuple[list[Any], list[str | None]]:
        """One instance per row, reset with the row's columns (without `environment` for a dict factory); returns
        the instances and what each reset returned (None or text to append to the prompt). `indices`: the rows'
        dataset indices, which an error names."""
        names = self.resolve_names([row.get("environment") for row in rows])
        used: dict[str | None, int] = {}
        instances, observations = [], []
        for k, (row, name) in enumerate(zip(rows, names)):
            pool, index = self.pools[name], used.get(name, 0)
            if index == len(pool):
                pool.append(_probe(name, self.factories[name]))
            used[name] = index + 1
            instance = pool[index]
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.named else dict(row)
            instances.append(instance)
            where = f" on dataset row {indices[k]}" if indices is not None else ""
            observations.append(_call(instance, "reset", (), kwargs, where))
        return instances, observations

    def reward_functions(self) -> list[Callable]:
        """One reward function per environment class with get_reward, named after the class."""
        out, seen = [], set()
        for pool in self.pools.values():
            cls = type(pool[0])
            if not callable(getattr(pool[0], "get_reward", None)) or cls in seen:
                continue
            seen.add(cls)
            out.append(_reward_of(cls))
        return out


def _reward_of(cls: type) -> Callable:
    def reward(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return [env.get_reward() if type(env) is cls else None for env in environments]

    reward.__name__ = cls.__name__
    reward.__doc__ = f"{cls.__name__}.get_reward() of each episode's environment (None for other environments)."
    if inspect.iscoroutinefunction(cls.get_reward):
        async def reward_async(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
            return [await env.get_reward() if type(env) is cls else None for env in environments]

        reward_async.__name__ = cls.__name__
        return reward_async
    return reward
