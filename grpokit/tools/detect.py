"""The "auto" tool-call format: read calls the way the tokenizer's chat template writes them.

    format_ = detect_tool_call_format(tokenizer, chat_template_kwargs)

In this order:

1. the tokenizer's own response parser (the "schema" format), when it has one this transformers can use;
2. the first registered format that reads back the call the chat template renders: a sentinel call is rendered as
   an assistant turn, and each format of TOOL_CALL_FORMATS parses that text; the one that finds exactly the
   sentinel's name and arguments is the model's format (so a format you register is detected too);
3. "qwen" (grpokit's default before "auto"), when the template renders no tool calls (plain-text prompts with
   a template that knows no tools), with a warning when it renders them in a way no format reads.
"""

from __future__ import annotations

import logging
from os.path import commonprefix
from typing import Any

from grpokit.tools.formats import TOOL_CALL_FORMATS
from grpokit.tools.schema import ResponseSchemaFormat, response_parsing

logger = logging.getLogger(__name__)

FALLBACK = "qwen"
NOT_DETECTED = {"auto", "schema", "response_schema"}  # formats that depend on the tokenizer are not candidates
_NAME, _KEY, _VALUE = "tool_name_c1e4", "arg_key_7b2d", "arg_value_5f0a"


def detect_tool_call_format(tokenizer, chat_template_kwargs: dict[str, Any] | None = None) -> Any:
    """The format object to read this tokenizer's model's tool calls with (see the module docstring)."""
    kwargs = dict(chat_template_kwargs or {})
    if response_parsing(tokenizer) is not None:
        logger.info("tool_call_format='auto': tool calls are read by the tokenizer's response parser ('schema').")
        return ResponseSchemaFormat().bind(tokenizer, kwargs)
    written = rendered_call(tokenizer, kwargs)
    if written is None:
        return TOOL_CALL_FORMATS.resolve(FALLBACK)
    for name in candidates():
        if reads_sentinel(TOOL_CALL_FORMATS.resolve(name), written):
            logger.info("tool_call_format='auto': tool calls are read as %r, the format the chat template writes.",
                        name)
            return TOOL_CALL_FORMATS.resolve(name)
    logger.warning(
        "tool_call_format='auto': no registered tool-call format reads the calls this chat template writes (%r); "
        "reading them as %r. Register a format that does (docs/tools.md) or set tool_call_format.",
        written[:200], FALLBACK)
    return TOOL_CALL_FORMATS.resolve(FALLBACK)


def candidates() -> list[str]:
    """Registered formats that need no tokenizer, one name per format, the built-in ones first."""
    seen, names = set(), []
    builtin = ["qwen", "qwen3_xml", "llama3", "harmony", "compact"]
    for name in builtin + [n for n in TOOL_CALL_FORMATS.names() if n not in builtin]:
        format_ = TOOL_CALL_FORMATS.resolve(name)
        if name in NOT_DETECTED or id(format_) in seen or callable(getattr(format_, "bind", None)):
            continue
        seen.add(id(format_))
        names.append(name)
    return names


def rendered_call(tokenizer, kwargs: dict[str, Any]) -> str | None:
    """The assistant turn the chat template renders for a sentinel call, as the model would write it (after the
    generation prompt, without the end-of-turn token); None when the template cannot render tool calls."""
    call = {"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VALUE}}}
    user = [{"role": "user", "content": "x"}]
    try:
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render tool calls: nothing to detect from
        return None
    if not isinstance(full, str) or _NAME not in full or _VALUE not in full:
        return None
    turn = full[len(commonprefix([prompt, full])):].rstrip()
    eos = getattr(tokenizer, "eos_token", None)
    return turn.removesuffix(eos).rstrip() if eos else turn


def reads_sentinel(format_: Any, written: str) -> bool:
    """Whether the format reads exactly the sentinel call from the rendered turn."""
    try:
        calls = format_.parse(written)
    except Exception:  # noqa: BLE001 - a format that cannot read this text is not the model's format
        return False
    return (len(calls) == 1 and calls[0].error is None and calls[0].name == _NAME
            and calls[0].arguments == {_KEY: _VALUE})


@TOOL_CALL_FORMATS.register("auto")
class AutoFormat:
    """Stands for the detected format until `bind` (grpokit.rollout.multiturn does it) replaces it."""

    name = "auto"

    def bind(self, tokenizer, chat_template_kwargs: dict[str, Any]) -> Any:
        return detect_tool_call_format(tokenizer, chat_template_kwargs)

    def parse(self, text: str):
        raise RuntimeError("tool_call_format='auto' must be bound to a tokenizer first: "
                           "grpokit.tools.bind_format(format_, tokenizer, chat_template_kwargs).")

    def render_results(self, results):
        raise RuntimeError("tool_call_format='auto' must be bound to a tokenizer first.")
