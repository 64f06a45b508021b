"""Training versions of chat templates that are not prefix-preserving.

An episode appends tool results and environment answers to the tokens the model generated, never re-tokenising
them, so grpokit needs the tokens a chat template writes after an assistant turn. It finds them by rendering a
short conversation with and without the new messages (grpokit.rollout.multiturn.ChatRenderer), which only works
when the template renders earlier turns the same way whatever follows ("prefix-preserving"). Some stock
templates do not:

- Qwen3 (and Qwen3.5 / 3.6, and Qwen3.8 with preserve_thinking=False) write the think block of an assistant turn
  only while it comes after the last user message (Qwen3: only while it is the last message, or has reasoning);
- GPT-OSS ends the last assistant message with <|return|> when nothing follows it and with <|end|> otherwise.

Each entry of `TRAINING_TEMPLATES` rewrites the one construct of a family's template that looks at the position
of a message, so that every assistant turn is rendered as its own content says:

- "qwen3": the think block is written when the turn has reasoning, wherever the turn is;
- "gpt-oss": a final answer always ends with <|end|> (the stock rendering of every answer but a last one without
  a generation prompt, which is never a prompt).

A rewrite applies when its first pattern is in the template, so it also covers fine-tunes that changed other
parts of the template (TRL's training templates match the stock text byte for byte); the caller checks the result
is prefix-preserving before using it. Prompts are still rendered by the stock template; a rewritten template
renders every prompt whose earlier assistant turns have no reasoning as the stock one does (tests/test_families.py
checks it per family). Add an entry for another family with `TRAINING_TEMPLATES.register(name, TemplateRewrite(...))`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from grpokit.registry import Registry


@dataclass(frozen=True)
class TemplateRewrite:
    """Regex substitutions on a template's text; `families`: who ships the construct (for messages and docs)."""

    families: str
    substitutions: tuple[tuple[str, str], ...]  # (pattern, replacement); applies when the first pattern is found

    def apply(self, template: str) -> str | None:
        """The rewritten template, or None when this rewrite is not for it."""
        if not re.search(self.substitutions[0][0], template):
            return None
        for pattern, replacement in self.substitutions:
            template = re.sub(pattern, replacement, template)
        return template


TRAINING_TEMPLATES = Registry("training chat template", import_paths=False,
                              expected="a TemplateRewrite with apply(template) -> str | None")

TRAINING_TEMPLATES.register("qwen3", TemplateRewrite(
    "Qwen3, Qwen3.5, Qwen3.6 (Qwen3.8 with preserve_thinking=False)",
    ((r"loop\.index0\s*>\s*ns\.last_query_index", "reasoning_content"),
     (r"loop\.last\s+or\s+\(\s*not\s+loop\.last\s+and\s+reasoning_content\s*\)", "reasoning_content")),
))

TRAINING_TEMPLATES.register("gpt-oss", TemplateRewrite(
    "GPT-OSS",
    ((r"loop\.last\s+and\s+not\s+add_generation_prompt", "false"),),
))


def training_template(template: str) -> tuple[str, str] | None:
    """(name, rewritten template) of the first registered rewrite that changes `template`, or None."""
    if not isinstance(template, str):
        return None
    for name in TRAINING_TEMPLATES.names():
        rewritten = TRAINING_TEMPLATES[name].apply(template)
        if rewritten is not None and rewritten != template:
            return name, rewritten
    return None
