"""Small text helpers shared by the reward functions: completion text, tag and code-block extraction."""

from __future__ import annotations

import re
from typing import Any

# Every fenced block, left to right, whatever its label; matching only python-labelled openings would let the
# closing fence of a ```cpp block pass for the opening of an unlabelled one.
_CODE_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_FENCE_LABELS = ("", "python", "python3", "py")


def completion_text(completion: Any) -> str:
    """The text of one completion, in either of the two forms TRL uses.

    A plain string is returned as is. A conversational completion (a list of messages such as
    [{"role": "assistant", "content": "..."}]) gives the contents of its messages joined by newlines; a content
    that is a list of parts ([{"type": "text", "text": "..."}]) contributes its text parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        texts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, (list, tuple)):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(content if isinstance(content, str) else str(content))
        return "\n".join(texts)
    return str(completion)


def excerpt(text: str, limit: int = 200) -> str:
    """`repr` of the first `limit` characters of `text`, with the number of characters left out."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text) - limit} more characters)"


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last <tag>...</tag> pair in `text`, stripped; None when there is none."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def extract_code_block(text: str) -> str | None:
    """Body of the last fenced code block labelled python/python3/py or unlabelled; None when there is none."""
    blocks = [body for label, body in _CODE_FENCE.findall(text) if label.lower() in PYTHON_FENCE_LABELS]
    return blocks[-1] if blocks else None
