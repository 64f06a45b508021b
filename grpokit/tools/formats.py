"""Tool-call formats: how a model writes a tool call in its text, and (for plain-text prompts) how results are
written back. `TOOL_CALL_FORMATS` is the only list of formats; `tool_call_format` picks one by name or import path.

A format is an object with

    name: str
    parse(text) -> list[ToolCall]          # the calls in one model turn, in order ([] for a final answer)
    render_results(results) -> str         # the text appended after the turn, for plain-text prompts only
    content(text) -> str                   # optional: the turn's text without its calls (the message content)

Conversational prompts never use render_results: their tool results are tool messages rendered by the model's chat
template (grpokit.rollout.multiturn). A call that cannot be read (bad JSON, no name) is still a ToolCall, with
`error` set, so the model is told what was wrong instead of the rollout crashing.

Built in:

- "qwen" (also "hermes"): Qwen2.5 / Qwen3 / Hermes style, one JSON object per call between tags:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>``; results
  ``<tool_response>\\n1786\\n</tool_response>\\n``.
- "compact": ``<call>name(argument)</call>`` for one-argument tools, results ``<result>1786</result>``; for tiny
  character-level models (each character is a generated token), as in the tool demo.

Add one from your own code:

    @TOOL_CALL_FORMATS.register("mine")
    class Mine:
        name = "mine"
        def parse(self, text): ...
        def render_results(self, results): ...
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from grpokit.algorithms.registry import Registry


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and keyword arguments, or `error` when it could not be read.
    `positional`: a single positional argument (formats such as "compact"), passed as the tool's first parameter."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    positional: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as a chat-template `tool_calls` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolResult:
    """What one call returned, as the text the model will read; `failed` when the call raised, timed out, named an
    unknown tool or could not be parsed (the text is then a JSON {"error": ...} object)."""

    name: str
    content: str
    failed: bool = False


def _instantiate(target: Any, name: str) -> Any:
    return target() if isinstance(target, type) else target


TOOL_CALL_FORMATS = Registry(
    "tool_call_format", wrap=_instantiate, expected="a format class or object with parse(text) and render_results(results)"
)


def resolve_format(spec: Any) -> Any:
    """A format object from a registered name, an import path, or an object with parse/render_results."""
    if not isinstance(spec, str):
        format_ = spec() if isinstance(spec, type) else spec
    else:
        format_ = TOOL_CALL_FORMATS.resolve(spec)
        if isinstance(format_, type):
            format_ = format_()
    if not callable(getattr(format_, "parse", None)):
        raise ValueError(f"tool_call_format={spec!r}: a format needs a parse(text) -> list[ToolCall] method.")
    return format_


def _loads(raw: str) -> Any:
    """json.loads; any failure (bad JSON, a 5000-digit number, nesting deep enough to recurse out) -> ValueError."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})") from exc
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"the tool call's JSON cannot be read ({type(exc).__name__})") from exc


def _call_from_json(raw: str) -> ToolCall:
    """One `{"name": ..., "arguments": {...}}` object -> ToolCall (error set when it is not one)."""
    try:
        data = _loads(raw)
    except ValueError as exc:
        return ToolCall(name="", error=str(exc))
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall(name="", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=data["name"], error="the tool call's arguments must be a JSON object")
    return ToolCall(name=data["name"], arguments=arguments)


@TOOL_CALL_FORMATS.register("qwen")
@TOOL_CALL_FORMATS.register("hermes")
class QwenFormat:
    """``<tool_call>{json}</tool_call>`` calls (any number per turn); an unclosed last tag counts as a call."""

    name = "qwen"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [_call_from_json(body.strip()) for body in self.CALL.findall(text)]

    def render_results(self, results: list[ToolResult]) -> str:
        return "".join(f"<tool_response>\n{r.content}\n</tool_response>\n" for r in results)

    def content(self, text: str) -> str:
        return self.CALL.sub("", text).strip()


@TOOL_CALL_FORMATS.register("compact")
class CompactFormat:
    """``<call>name(argument)</call>``: one positional argument, passed as the tool's first parameter."""

    name = "compact"
    CALL = re.compile(r"<call>(.*?)(?:</call>|$)", re.DOTALL)
    BODY = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self.CALL.findall(text):
            match = self.BODY.fullmatch(body)
            if match is None:
                calls.append(ToolCall(name="", error="a call must look like <call>name(argument)</call>"))
            else:
                calls.append(ToolCall(name=match.group(1), positional=match.group(2)))
        return calls

    def render_results(self, results: list[ToolResult]) -> str:
        return "".join(f"<result>{r.content}</result>" for r in results)

    def content(self, text: str) -> str:
        return self.CALL.sub("", text).strip()
