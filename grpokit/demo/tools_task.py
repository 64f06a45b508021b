"""The tool demo's task: two-digit multiplication, where a calculator tool helps and guessing rarely does.

A prompt is the bare product, ``"47*38="``. The model may answer at once, ``<a>1790</a>`` (a guess: a tiny model
cannot multiply), or call the calculator first in the "compact" tool-call format and copy its result::

    47*38=<call>calc(47*38)</call>|<result>1786</result><a>1786</a>|

where ``|`` is the end-of-turn token. ``<result>...</result>`` is written by the tool, not the model: it is in the
context of the second turn and never in the loss. The reward is 1.0 when the number in the last ``<a>...</a>``
is the product, else 0.0; the tool-call rate is measured, never rewarded. The split is fixed (``SPLIT_SEED``), with
``a*b`` and ``b*a`` on the same side.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from grpokit.rollout.engine import SamplingParams, pad_rollout
from grpokit.rollout.generate import left_pad
from grpokit.rollout.multiturn import Episodes, MultiTurn
from grpokit.tools import Toolbox, calculator, resolve_format

LOW, HIGH = 10, 99
SPLIT_SEED = 4321
NUM_HELDOUT = 400
MAX_COMPLETION_LENGTH = 64  # the longest tool transcript (a 4-digit product) is 58 tokens, 21 of them the tool's
ANSWER = re.compile(r"<a>([^<>]*)</a>")


def calc(expression: str) -> str:
    """Multiply (or add, subtract, divide) exactly.

    Args:
        expression: An arithmetic expression such as 47*38.
    """
    return calculator(expression)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> int:
        return self.a * self.b

    def row(self) -> dict[str, str | int]:
        return {"prompt": self.prompt, "answer": self.answer}


def split_problems(num_heldout: int = NUM_HELDOUT, seed: int = SPLIT_SEED) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): every ordered pair in [LOW, HIGH]^2, commuted pairs on one side, fixed order."""
    pairs = sorted({(min(a, b), max(a, b)) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)})
    random.Random(seed).shuffle(pairs)
    held_out: list[Problem] = []
    train: list[Problem] = []
    for x, y in pairs:
        side = held_out if len(held_out) < num_heldout else train
        side.extend({Problem(x, y), Problem(y, x)})
    order = lambda p: (p.a, p.b)  # noqa: E731
    return sorted(train, key=order), sorted(held_out, key=order)


def extract_answer(completion: str) -> int | None:
    """The integer in the last ``<a>...</a>``, or None."""
    found = ANSWER.findall(completion)
    return int(found[-1]) if found and re.fullmatch(r"\d+", found[-1].strip()) else None


def correctness_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the number in the last <a>...</a> of the transcript equals the `answer` column, else 0.0."""
    return [1.0 if extract_answer(c) == int(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def runner(tokenizer) -> MultiTurn:
    """The episode loop of the demo: the calc tool, the compact format, plain-text prompts."""
    return MultiTurn(tokenizer, Toolbox([calc]), resolve_format("compact"), [tokenizer.eos_token_id], False,
                     max_iterations=1)


def greedy_generate(model, tokenizer):
    """A `generate` for MultiTurn that decodes greedily with transformers (for evaluation)."""

    @torch.no_grad()
    def generate(prompt_ids, sample_ids, params: SamplingParams):
        ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=params.max_completion_length, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        tokens = [row[ids.shape[1]:].tolist() for row in out]
        return pad_rollout(tokens, None, [tokenizer.eos_token_id], tokenizer.pad_token_id)

    return generate


def evaluate(model, tokenizer, problems: Sequence[Problem], batch_size: int = 200) -> dict[str, float | None]:
    """Greedy episodes on `problems`: accuracy (reward 1.0), tool-call rate, and accuracy with and without a call
    (None when no episode called the tool, or none answered without it)."""
    was_training = model.training
    model.eval()
    loop, generate = runner(tokenizer), greedy_generate(model, tokenizer)
    correct, called = [], []
    try:
        for start in range(0, len(problems), batch_size):
            part = problems[start : start + batch_size]
            prompt_ids = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in part]
            episodes: Episodes = loop.run(generate, prompt_ids, torch.arange(len(part)),
                                          SamplingParams(MAX_COMPLETION_LENGTH))
            correct += correctness_reward([], episodes.completions, [p.answer for p in part])
            called += [float(c > 0) for c in episodes.tool_calls]
    finally:
        model.train(was_training)
    with_call = [c for c, t in zip(correct, called) if t]
    without = [c for c, t in zip(correct, called) if not t]
    return {
        "accuracy": sum(correct) / len(correct),
        "tool_call_rate": sum(called) / len(called),
        "accuracy_with_call": sum(with_call) / len(with_call) if with_call else None,  # None: no such episode
        "accuracy_without_call": sum(without) / len(without) if without else None,
    }
