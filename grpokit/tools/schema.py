"""The "schema" tool-call format: the tokenizer's own response parser (`tokenizer.parse_response`).

transformers reads a model's output into a message (content, reasoning, tool calls) with the tokenizer's
`response_template` (transformers >= 5.13; some Hub tokenizers ship one, TRL's `add_response_schema` sets one for
the templates it knows) or, on older 5.x, its legacy `response_schema`. This format uses whichever the installed
transformers can read; `response_parsing(tokenizer)` says which, and "auto" (grpokit/tools/detect.py) prefers it
to grpokit's own formats whenever it is there. Tool-call arguments are typed by the tools' JSON schemas where
transformers can (>= 5.15: "7" becomes 7 for an integer parameter).

A turn the parser rejects (a malformed call) is one ToolCall with `error` set, so the model reads what went
wrong, as with every other format. There is no `render_results`: plain-text prompts need a format that writes
results as text.
"""

from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

from grpokit.tools.formats import TOOL_CALL_FORMATS, ToolCall, _with_arguments

RESPONSE_TEMPLATE_SINCE = Version("5.13.0.dev0")  # response_template and parse_response(prefix=)
TYPED_ARGUMENTS_SINCE = Version("5.15.0")  # parse_response(tools=)


def response_parsing(tokenizer) -> str | None:
    """"template" when the tokenizer has a response_template this transformers reads, "schema" for a legacy
    response_schema it reads, None when parse_response cannot be used."""
    if not callable(getattr(tokenizer, "parse_response", None)):
        return None
    installed = Version(transformers.__version__)
    if getattr(tokenizer, "response_template", None) is not None and installed >= RESPONSE_TEMPLATE_SINCE:
        return "template"
    if getattr(tokenizer, "response_schema", None) is not None and installed < RESPONSE_TEMPLATE_SINCE:
        return "schema"
    return None


def generation_prompt(tokenizer, chat_template_kwargs: dict[str, Any]) -> str:
    """What the chat template writes to open an assistant turn (e.g. "<|im_start|>assistant\\n"): the context a
    response template needs to know where the model's text starts."""
    kwargs = {k: v for k, v in chat_template_kwargs.items() if k != "tools"}
    user = [{"role": "user", "content": "x"}]
    before = tokenizer.apply_chat_template(user, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs)
    return after[len(before):] if after.startswith(before) else ""


@TOOL_CALL_FORMATS.register("schema")
@TOOL_CALL_FORMATS.register("response_schema")
class ResponseSchemaFormat:
    """Calls read by `tokenizer.parse_response`; the message's content and reasoning come from it too."""

    name = "schema"

    def __init__(self, tokenizer=None, prefix: str = "", tools: list | None = None) -> None:
        self.tokenizer, self.prefix, self.tools = tokenizer, prefix, tools
        self._last: tuple[str, dict] | None = None  # parse and message read the same turn: parse it once

    def bind(self, tokenizer, chat_template_kwargs: dict[str, Any]) -> "ResponseSchemaFormat":
        if response_parsing(tokenizer) is None:
            raise ValueError(
                f"tool_call_format='schema' reads calls with tokenizer.parse_response, which needs a tokenizer with a "
                f"response_template (transformers >= 5.13; installed {transformers.__version__}) or, before 5.13, a "
                "response_schema. Set one (TRL's trl.chat_template_utils.add_response_schema(tokenizer) does it for "
                "the templates TRL knows) or choose a grpokit format: tool_call_format='auto' picks the one the chat "
                "template writes."
            )
        return ResponseSchemaFormat(tokenizer, generation_prompt(tokenizer, chat_template_kwargs),
                                    chat_template_kwargs.get("tools"))

    def parsed(self, text: str) -> dict[str, Any]:
        """The parser's message for this turn; {"error": ...} when it rejects the turn."""
        if self._last is not None and self._last[0] == text:
            return self._last[1]
        try:
            message = self._parse(text)
            if not isinstance(message, dict):
                raise ValueError(f"the parser returned {type(message).__name__}, not a message")
        except Exception as exc:  # noqa: BLE001 - a parser failure is the model's malformed output
            message = {"error": f"the tool call cannot be read ({type(exc).__name__}: {exc})"}
        self._last = (text, message)
        return message

    def _parse(self, text: str) -> Any:
        eos = getattr(self.tokenizer, "eos_token", None)
        ended = any(text.endswith(t) for t in getattr(self.tokenizer, "all_special_tokens", ()))
        if eos and not ended:  # the turn comes without its EOS (another stop, <|call|>, stays), which parsers expect
            text += eos
        if response_parsing(self.tokenizer) == "schema":  # the legacy parser takes the text alone
            return self.tokenizer.parse_response(text)
        if Version(transformers.__version__) >= TYPED_ARGUMENTS_SINCE and self.tools:
            return self.tokenizer.parse_response(text, prefix=self.prefix, tools=self.tools)
        return self.tokenizer.parse_response(text, prefix=self.prefix)

    def parse(self, text: str) -> list[ToolCall]:
        message = self.parsed(text)
        if "error" in message:
            return [ToolCall(name="", error=message["error"])]
        return [self._call(entry) for entry in message.get("tool_calls") or []]

    @staticmethod
    def _call(entry: Any) -> ToolCall:
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return ToolCall(name="", error='a tool call must name its function: {"name": ..., "arguments": {...}}')
        return _with_arguments(function["name"], function.get("arguments") or {})

    def message(self, text: str) -> dict[str, Any]:
        message = self.parsed(text)
        if "error" in message:
            return {"content": text}
        fields = {k: v for k, v in message.items() if k not in ("role", "tool_calls") and v is not None}
        content = fields.get("content") or ""
        eos = getattr(self.tokenizer, "eos_token", None)
        fields["content"] = content.removesuffix(eos) if isinstance(content, str) and eos else content
        return fields
