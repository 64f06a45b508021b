"""Reward functions and small utilities used by several test files."""

import json
from pathlib import Path


def frac_a(prompts, completions, **kwargs):
    """Fraction of the completion's characters that are 'a' (a reward the tiny model can learn fast)."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def short(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
