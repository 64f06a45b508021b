"""Tool-call formats: how a model writes a tool call in its text, and (for plain-text prompts) how results are
written back. `TOOL_CALL_FORMATS` is the only list of formats; `tool_call_format` picks one by name or import path.

A format is an object with

    name: str
    parse(text) -> list[ToolCall]          # the calls in one model turn, in order ([] for a final answer)
    render_results(results) -> str         # the text appended after the turn, for plain-text prompts only
    content(text) -> str                   # optional: the turn's text without its calls (the message content)
    message(text) -> dict                  # optional, instead of content: the assistant message's fields
                                           # ("content", and e.g. "thinking") from the turn with special tokens
    bind(tokenizer, chat_template_kwargs)  # optional: the format to use with this tokenizer (a new object)

`parse` and `message` see the turn with special tokens kept and without its end-of-turn token; `content` sees it
decoded without special tokens. Conversational prompts never use render_results: their tool results are tool
messages rendered by the model's chat template (grpokit.rollout.multiturn). A call that cannot be read (bad JSON,
no name) is still a ToolCall, with `error` set, so the model is told what was wrong instead of the rollout crashing.

Built in (the model families each one serves: docs/tools.md):

- "qwen" (also "hermes"): Qwen2.5 / Qwen3 / Hermes style, one JSON object per call between tags:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>``; results
  ``<tool_response>\\n1786\\n</tool_response>\\n``.
- "qwen3_xml": Qwen3-Coder / Qwen3.5 / Qwen3.6 / Nemotron 3, ``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter></function></tool_call>`` (with newlines), values typed by the tool's schema; results as "qwen"'s.
- "llama3": Llama 3.1 / 3.2 / 3.3 JSON calls, the whole turn ``{"name": "calculator", "parameters": {...}}``,
  bare or after ``<|python_tag|>``; results as an ipython turn.
- "harmony": GPT-OSS, a message to ``functions.NAME`` on the commentary channel whose body is the arguments:
  ``<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{...}<|call|>``; results as a
  message from ``functions.NAME`` to the assistant.
- "compact": ``<call>name(argument)</call>`` for one-argument tools, results ``<result>1786</result>``; for tiny
  character-level models (each character is a generated token), as in the tool demo.
- "schema" (grpokit/tools/schema.py): the tokenizer's own response parser (`tokenizer.parse_response`,
  transformers >= 5.13), and "auto" (grpokit/tools/detect.py): the format the tokenizer's chat template writes.

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

from grpokit.registry import Registry


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and keyword arguments, or `error` when it could not be read.
    `positional`: a single positional argument (formats such as "compact"), passed as the tool's first parameter.
    `typed`: False when the argument values are text the format could not type (XML formats such as
    "qwen3_xml"); the toolbox types them by the tool's JSON schema before the call."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    positional: str | None = None
    typed: bool = True

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
    return _call_from_value(data)


def _call_from_value(data: Any) -> ToolCall:
    """A decoded `{"name": ..., "arguments": {...}}` object ("parameters" read as "arguments") -> ToolCall."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall(name="", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    return _with_arguments(data["name"], data.get("arguments", data.get("parameters", {})))


def _with_arguments(name: str, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error="the tool call's arguments must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def _json_objects(text: str, separators: str = ";") -> list[ToolCall]:
    """Calls written as JSON objects one after another (whitespace or `separators` between them); reading stops
    at the first text that does not start an object, and an object that does not decode is one call with its
    error."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            return calls + [ToolCall(name="", error=f"the tool call is not valid JSON ({exc.msg} at character "
                                                    f"{exc.pos})")]
        except (ValueError, RecursionError) as exc:
            return calls + [ToolCall(name="", error=f"the tool call's JSON cannot be read ({type(exc).__name__})")]
        calls.append(_call_from_value(value))


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


@TOOL_CALL_FORMATS.register("qwen3_xml")
class QwenXmlFormat:
    """Qwen3-Coder / Qwen3.5 / Qwen3.6 / Nemotron 3 calls, XML between the Hermes tags:
    ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``. Values are
    text (the templates write them so), typed by the tool's JSON schema when the call runs ("20" -> 20 for an
    integer parameter, as transformers >= 5.15 types them). Results as "qwen"'s."""

    name = "qwen3_xml"
    CALL = QwenFormat.CALL
    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [self._read(body) for body in self.CALL.findall(text)]

    def _read(self, body: str) -> ToolCall:
        match = self.FUNCTION.match(body)
        if match is None:
            return ToolCall(name="", error="a call must look like <tool_call><function=NAME><parameter=KEY>VALUE"
                                           "</parameter></function></tool_call>")
        arguments = {key.strip(): value for key, value in self.PARAMETER.findall(match[2])}
        return ToolCall(name=match[1].strip(), arguments=arguments, typed=False)

    render_results = QwenFormat.render_results
    content = QwenFormat.content


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


@TOOL_CALL_FORMATS.register("llama3")
class Llama3Format:
    """Llama 3.1 / 3.2 / 3.3 JSON calls: the turn is ``{"name": ..., "parameters": {...}}`` ("arguments" is read
    too), bare or after ``<|python_tag|>``; several separated by ';' are read as vLLM's llama3_json parser reads
    them (the stock templates render one call per turn). A turn that does not start with ``{"name"`` (or the tag)
    is a final answer. Results: an ipython turn each, as the templates render tool messages (strings as JSON)."""

    name = "llama3"
    TAG = "<|python_tag|>"
    CALL_START = re.compile(r'\{\s*"name"\s*:')
    TRAILER = re.compile(r"(?:<\|eom_id\|>|<\|eot_id\|>|\s)+$")

    def parse(self, text: str) -> list[ToolCall]:
        body = self.TRAILER.sub("", text).lstrip()
        if body.startswith(self.TAG):
            return _json_objects(body[len(self.TAG):]) or [ToolCall(
                name="", error='after <|python_tag|> write the call as JSON: {"name": ..., "parameters": {...}}')]
        return _json_objects(body) if self.CALL_START.match(body) else []

    def render_results(self, results: list[ToolResult]) -> str:
        turns = "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{json.dumps(r.content, ensure_ascii=False)}"
                        "<|eot_id|>" for r in results)
        return turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"

    def content(self, text: str) -> str:
        return ""  # a call turn is only the call (the templates render no content beside it)


@TOOL_CALL_FORMATS.register("harmony")
class HarmonyFormat:
    """GPT-OSS (OpenAI harmony). A turn is one or more assistant messages (the first one's ``<|start|>assistant``
    is the generation prompt's); a message whose header names the recipient ``to=functions.NAME`` (after its
    channel, as the model writes it, or before, as the chat template renders it) is a call, its body the JSON
    arguments. The message content is the final channel's text, the analysis channel's is "thinking"."""

    name = "harmony"
    MESSAGE = re.compile(r"(?P<header>.*?)<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
                         re.DOTALL)
    RECIPIENT = re.compile(r"\bto=([^\s<]+)")
    CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    SPECIAL = re.compile(r"<\|[a-z_]+\|>")

    def messages(self, text: str) -> list[tuple[str | None, str | None, str]]:
        """(channel, recipient, body) of each assistant message of the turn."""
        out = []
        for k, part in enumerate(text.split("<|start|>")):
            match = self.MESSAGE.match(part)
            if match is None or (k > 0 and not part.startswith("assistant")):
                continue  # no message yet, or one the model wrote in another role's name
            channel, recipient = self.CHANNEL.search(match["header"]), self.RECIPIENT.search(match["header"])
            out.append((channel and channel[1], recipient and recipient[1], match["body"]))
        return out

    def parse(self, text: str) -> list[ToolCall]:
        return [self._call(recipient, body) for _, recipient, body in self.messages(text) if recipient]

    @staticmethod
    def _call(recipient: str, body: str) -> ToolCall:
        if not recipient.startswith("functions."):
            return ToolCall(name=recipient, error=f"a call goes to functions.NAME (e.g. to=functions.calculator); "
                                                  f"{recipient!r} is not a function")
        name = recipient[len("functions."):]
        try:
            arguments = _loads(body.strip())
        except ValueError as exc:
            return ToolCall(name=name, error=str(exc))
        return _with_arguments(name, arguments)

    def message(self, text: str) -> dict[str, Any]:
        messages = self.messages(text)
        if not messages:  # no harmony structure at all: the text as written
            return {"content": self.SPECIAL.sub("", text).strip()}
        final = [body for channel, to, body in messages if channel == "final" and not to]
        thinking = [body for channel, to, body in messages if channel == "analysis" and not to]
        return {"content": final[-1] if final else "", **({"thinking": "\n".join(thinking)} if thinking else {})}

    def render_results(self, results: list[ToolResult]) -> str:
        return "".join(f"<|start|>functions.{r.name} to=assistant<|channel|>commentary<|message|>"
                       f"{json.dumps(r.content, ensure_ascii=False)}<|end|>" for r in results) + "<|start|>assistant"


def bind_format(format_: Any, tokenizer, chat_template_kwargs: dict[str, Any] | None = None) -> Any:
    """The format to use with this tokenizer: `format_.bind(tokenizer, chat_template_kwargs)` for formats that
    depend on it ("auto", "schema"), else `format_` itself."""
    bind = getattr(format_, "bind", None)
    return bind(tokenizer, dict(chat_template_kwargs or {})) if callable(bind) else format_
