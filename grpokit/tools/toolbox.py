"""Tools the model may call during a rollout: plain Python functions with type hints and a docstring.

    toolbox = Toolbox([calculator, my_search], timeout=10.0)
    toolbox.schemas                      # JSON schemas (transformers.utils.get_json_schema), for the chat template
    results = toolbox.run(calls)         # list[ToolCall] -> list[ToolResult]; never raises

Every failure becomes a result the model reads, as a JSON object {"error": "..."}: a call that could not be parsed,
an unknown tool name, arguments the function does not take, an exception raised by the function, and a call that
did not return within `timeout` seconds. A call that timed out keeps its thread (Python cannot stop a running
function), so a tool that may hang, or that runs model-written code, should do its work in a subprocess with its
own deadline, as the built-in `python` tool does through grpokit.sandbox.

`TOOLS` is the only list of named tools ("calculator", "python"); a YAML config names tools from it or by import
path ("my_package.tools:search").
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import threading
import weakref
from typing import Any, Callable, Sequence

from transformers.utils import get_json_schema

from grpokit.algorithms.registry import Registry
from grpokit.tools.formats import ToolCall, ToolResult

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


class Toolbox:
    """Named tools with their schemas, and a runner that turns every call into a result the model can read.

    tools: functions (or TOOLS names / import paths "pkg.module:function"); timeout: seconds one call may take.
    """

    def __init__(self, tools: Sequence[Any], timeout: float = 10.0) -> None:
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        self.inline: set[str] = set()  # environment methods: run in the calling thread, without a timeout
        self.timeout = timeout
        for tool in tools:
            self.add(tool)

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

    def with_methods(self, methods: Sequence[Callable]) -> "Toolbox":
        """A toolbox with these tools plus an environment's methods, which run in the calling thread (where the
        environment's reset, step and get_reward run too, so thread-bound state such as a sqlite connection works,
        and a slow call cannot change the environment after its episode ended); they have no timeout."""
        box = Toolbox([], self.timeout)
        box.functions, box.schemas, box.inline = dict(self.functions), list(self.schemas), set(self.inline)
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
        try:
            arguments = copy.deepcopy(call.arguments)  # the transcript keeps the call as the model wrote it
        except Exception:  # noqa: BLE001 - not copyable: the tool gets the original
            arguments = dict(call.arguments)
        if not call.typed:  # text values (XML formats): typed by the tool's JSON schema
            arguments = typed_arguments(arguments, self.schema(call.name))
        if call.positional is not None:  # a format with one positional argument (e.g. "compact")
            first = _first_parameter(func)
            if first is None:
                return _error(call.name, f"tool {call.name!r} takes no arguments")
            arguments = {first: call.positional, **arguments}
        outcome: dict[str, Any] = {}

        def target() -> None:  # the result is converted here too, so a huge one is under the timeout
            try:
                value = func(**arguments)
                if inspect.isawaitable(value):
                    value = asyncio.run(_await(value))
                outcome["text"] = _as_text(value)
            except BaseException as exc:  # noqa: BLE001 - reported to the model
                outcome["error"] = _describe_exception(exc)

        if call.name in self.inline:
            target()
        else:
            worker = threading.Thread(target=target, name=f"grpokit-tool-{call.name}", daemon=True)
            worker.start()
            worker.join(self.timeout)
            if worker.is_alive():
                return _error(call.name, f"tool {call.name!r} did not return within {self.timeout:g} s")
        if "error" in outcome:
            return _error(call.name, outcome["error"])
        text = outcome["text"]
        if len(text) > MAX_RESULT_CHARS:
            text = text[:MAX_RESULT_CHARS] + f"... [cut: {len(text)} characters in all]"
        return ToolResult(name=call.name, content=text)


async def _await(value):
    return await value
