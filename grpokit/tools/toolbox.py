"""Tools the model may call during a rollout: plain Python functions with type hints and a docstring.

    toolbox = Toolbox([calculator, my_search], timeout=10.0)
    toolbox.schemas                      # JSON schemas (transformers.utils.get_json_schema), for the chat template
    results = toolbox.run(calls)         # list[ToolCall] -> list[ToolResult]; never raises

Every failure becomes a result the model reads, as a JSON object {"error": "..."}: a call that could not be parsed,
an unknown tool name, arguments the function does not take, an exception raised by the function (SystemExit and
other BaseExceptions included), a call that did not return within `timeout` seconds, and a call whose process
ended without an answer.

Standalone tools run in a worker process forked from the trainer (grpokit.tools.worker: it holds every tool as
the trainer does, closures included, and only the arguments are pickled); the worker is killed with every process
it started when a call passes its timeout, and replaced when it leaks memory or a call leaves a thread running, so
a tool that hangs, spins, leaks or forks cannot outlive its call or slow the trainer. What a tool changes in
Python memory stays in the worker. An environment's methods run in the trainer's thread (they are the state of a
stateful object), without a timeout. docs/tools.md ("Where tools run") draws the line and gives its cost.

`TOOLS` is the only list of named tools ("calculator", "python"); a YAML config names tools from it or by import
path ("my_package.tools:search").
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import weakref
from typing import Any, Callable, Sequence

from transformers.utils import get_json_schema

from grpokit.registry import Registry
from grpokit.tools.formats import ToolCall, ToolResult
from grpokit.tools.worker import ToolWorker

TOOLS = Registry("tools", expected="a function with type hints and a docstring with an Args: section")
MAX_CALLS_PER_TURN = 32  # calls after these in one turn are answered with an error, not run
MAX_RESULT_CHARS = 50_000  # a longer result is cut (it would not fit in any completion budget anyway)


class ToolError(ValueError):
    """A tool cannot be used (no docstring, no type hints, a duplicate name); the message says how to fix it."""


# function -> its schema; a bound method is keyed by its class's function, so an environment's methods are described
# once, not once per episode (get_json_schema parses the docstring: ~1 ms each)
_SCHEMAS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def tool_schema(func: Callable) -> dict:
    """The function's JSON schema, or a ToolError naming what its docstring or hints lack."""
    key = getattr(func, "__func__", func)
    try:
        return _SCHEMAS[key]
    except (KeyError, TypeError):  # not described yet, or not weak-referenceable (then never cached)
        pass
    schema = _describe(func)
    try:
        _SCHEMAS[key] = schema
    except TypeError:
        pass
    return schema


def _describe(func: Callable) -> dict:
    name = getattr(func, "__name__", repr(func))
    try:
        return get_json_schema(func)
    except Exception as exc:  # transformers raises its own TypeError subclasses with the reason
        raise ToolError(
            f"Tool {name!r} cannot be described to the model: {exc}. A tool needs type hints on every argument and "
            "a Google-style docstring with a one-line description and an 'Args:' section describing each argument."
        ) from exc


def _as_text(value: Any) -> str:
    """A result as text: strings as they are, structures as JSON, anything else by str(); never raises."""
    if isinstance(value, str):
        return value
    for convert in (json.dumps, str, repr):
        try:
            return convert(value)
        except BaseException:  # noqa: BLE001 - 10**5000, deep nesting, a __str__ that raises
            continue
    return f"<unprintable {type(value).__name__}>"


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_as_text(exc)}"


def _error(name: str, message: str) -> ToolResult:
    return ToolResult(name=name or "unknown", content=json.dumps({"error": message}), failed=True)


def typed_arguments(arguments: dict[str, Any], schema: dict) -> dict[str, Any]:
    """Text argument values typed by the tool's JSON schema: a string parameter keeps its text, any other is read
    as JSON ("20" -> 20, "[1, 2]" -> [1, 2]; Python's True / False / None too); text that does not read stays
    text, and the function reports the mismatch."""
    properties = schema.get("function", {}).get("parameters", {}).get("properties", {})
    return {key: _typed(value, properties.get(key, {})) for key, value in arguments.items()}


def _typed(value: Any, spec: dict) -> Any:
    types = spec.get("type")
    if not isinstance(value, str) or "string" in ([types] if isinstance(types, str) else types or []):
        return value
    text = value.strip()
    try:
        return json.loads({"True": "true", "False": "false", "None": "null"}.get(text, text))
    except (ValueError, RecursionError):
        return value


def _first_parameter(func: Callable) -> str | None:
    params = [p for p in inspect.signature(func).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return params[0].name if params else None


TOOL_ISOLATIONS = ("process", "inline")
"""Where standalone tools run (GRPOConfig.tool_isolation): "process", the forked worker, killed at the timeout;
"inline", the trainer's own thread, as environment methods run (no timeout; for tools that need the trainer's
memory: a CUDA model, state shared with reward functions)."""


class Toolbox:
    """Named tools with their schemas, and a runner that turns every call into a result the model can read.

    tools: functions (or TOOLS names / import paths "pkg.module:function"); timeout: seconds one call may take;
    isolation: one of TOOL_ISOLATIONS.
    """

    def __init__(self, tools: Sequence[Any], timeout: float = 10.0, isolation: str = "process") -> None:
        if isolation not in TOOL_ISOLATIONS:
            raise ToolError(f"tool_isolation={isolation!r} is not valid; choose one of: {', '.join(TOOL_ISOLATIONS)}.")
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        self.inline: set[str] = set()  # environment methods: run in the calling thread, without a timeout
        self.timeout, self.isolation = timeout, isolation
        self.worker = ToolWorker(self.functions, _call_tool)  # the other tools' process (forked at the first call)
        for tool in tools:
            self.add(tool, inline=isolation == "inline")

    def add(self, tool: Any, inline: bool = False) -> None:
        func = TOOLS.resolve(tool) if isinstance(tool, str) else tool
        if not callable(func):
            raise ToolError(f"Tool {tool!r} is not callable; pass functions (or their import paths 'pkg.module:fn').")
        schema = tool_schema(func)
        name = schema["function"]["name"]
        if name in self.functions:
            raise ToolError(f"Two tools are named {name!r}; tool names must be unique (rename one of the functions).")
        self.functions[name] = func
        self.schemas.append(schema)
        if inline:
            self.inline.add(name)
        else:  # a worker forked before holds the tools of then: the next call forks one with this tool too
            self.worker.close()

    def with_methods(self, methods: Sequence[Callable]) -> "Toolbox":
        """A toolbox with these tools plus an environment's methods, which run in the calling thread (where the
        environment's reset, step and get_reward run too, so thread-bound state such as a sqlite connection works,
        and a slow call cannot change the environment after its episode ended); they have no timeout."""
        box = Toolbox([], self.timeout, self.isolation)
        box.functions, box.schemas, box.inline = dict(self.functions), list(self.schemas), set(self.inline)
        box.worker = self.worker
        for method in methods:
            box.add(method, inline=True)
        return box

    def schema(self, name: str) -> dict:
        return next((s for s in self.schemas if s["function"]["name"] == name), {})

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; calls past MAX_CALLS_PER_TURN are not run."""
        results = [self.run_one(call) for call in calls[:MAX_CALLS_PER_TURN]]
        return results + [_error(call.name, f"more than {MAX_CALLS_PER_TURN} tool calls in one turn; this one was "
                                            "not run") for call in calls[MAX_CALLS_PER_TURN:]]

    def run_one(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return _error(call.name, call.error)
        func = self.functions.get(call.name)
        if func is None:
            known = ", ".join(sorted(self.functions)) or "none"
            return _error(call.name, f"unknown tool {call.name!r}; available tools: {known}")
        arguments = call.arguments
        if not call.typed:  # text values (XML formats): typed by the tool's JSON schema
            arguments = typed_arguments(arguments, self.schema(call.name))
        if call.positional is not None:  # a format with one positional argument (e.g. "compact")
            first = _first_parameter(func)
            if first is None:
                return _error(call.name, f"tool {call.name!r} takes no arguments")
            arguments = {first: call.positional, **arguments}
        if call.name in self.inline:
            outcome = _call_tool(func, _copied(arguments), keep=KeyboardInterrupt)
        else:
            outcome = self.worker.call(call.name, arguments, self.timeout)
        if "error" in outcome:
            return _error(call.name, outcome["error"])
        return ToolResult(name=call.name, content=outcome["text"])


def _copied(arguments: dict[str, Any]) -> dict[str, Any]:
    """A deep copy, so the transcript keeps the call as the model wrote it (a forked call needs none)."""
    try:
        return copy.deepcopy(arguments)
    except Exception:  # noqa: BLE001 - not copyable: the tool gets the original
        return dict(arguments)


def _call_tool(func: Callable, arguments: dict[str, Any], keep: type | tuple = ()) -> dict[str, str]:
    """{"text": the result, cut and valid UTF-8} or {"error": what the function raised, BaseExceptions included
    (SystemExit too: a tool must not end the trainer)}; `keep`: exceptions passed on (KeyboardInterrupt, in the
    trainer's own process, is the user's stop)."""
    try:
        value = func(**arguments)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        return {"text": _cut(_as_text(value))}
    except keep:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported to the model
        return {"error": _describe_exception(exc)}


def _cut(text: str) -> str:
    """At most MAX_RESULT_CHARS characters, with the full length noted; lone surrogates (which no tokenizer can
    encode) replaced."""
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"... [cut: {len(text)} characters in all]"
    return text.encode("utf-8", "replace").decode("utf-8")


async def _await(value):
    return await value
