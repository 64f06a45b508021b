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
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Mapping, Sequence

CONTROL_METHODS = ("reset", "respond", "get_reward")


class EnvironmentContractError(ValueError):
    """An environment factory or instance breaks the contract; the message says how."""


def environment_tools(environment: Any) -> list[Callable]:
    """An environment's public methods other than reset/respond/get_reward: the tools it offers the model.
    Found on the class, so properties are never evaluated."""
    return [
        getattr(environment, name) for name, member in inspect.getmembers_static(type(environment))
        if not name.startswith("_") and name not in CONTROL_METHODS and inspect.isfunction(member)
    ]


def call_environment(environment: Any, method: str, *args: Any, **kwargs: Any) -> str | None:
    """environment.method(...) awaited if it is a coroutine, its result as text (None stays None); an exception,
    or a result that cannot be turned into text, becomes an EnvironmentContractError naming the method."""
    name = f"{type(environment).__name__}.{method}()"
    try:
        result = getattr(environment, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        return None if result is None else str(result)
    except Exception as exc:
        columns = f" (row columns: {', '.join(kwargs)})" if kwargs else ""
        raise EnvironmentContractError(f"{name} raised {type(exc).__name__}: {exc}{columns}") from exc


async def _await(value: Any) -> Any:
    return await value


def _probe(name: str | None, factory: Callable) -> Any:
    label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    if not callable(factory):
        raise EnvironmentContractError(f"{label} must be a callable that returns an environment (e.g. the class itself).")
    try:
        instance = factory()
    except Exception as exc:
        raise EnvironmentContractError(f"{label}() raised {type(exc).__name__}: {exc}") from exc
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

    def reset(self, rows: Sequence[Mapping[str, Any]]) -> tuple[list[Any], list[str | None]]:
        """One instance per row, reset with the row's columns (without `environment` for a dict factory); returns
        the instances and what each reset returned (None or text to append to the prompt)."""
        names = self.resolve_names([row.get("environment") for row in rows])
        used: dict[str | None, int] = {}
        instances, observations = [], []
        for row, name in zip(rows, names):
            pool, index = self.pools[name], used.get(name, 0)
            if index == len(pool):
                pool.append(_probe(name, self.factories[name]))
            used[name] = index + 1
            instance = pool[index]
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.named else dict(row)
            instances.append(instance)
            observations.append(call_environment(instance, "reset", **kwargs))
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
