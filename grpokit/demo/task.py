"""The demo task: two-digit addition with a column-sum scratchpad, in a compact R1-style format.

A prompt is the bare sum, ``"47+38="``. A well-formed completion shows its reasoning (the column sums, ones
column first, the tens column including the carry) and then the answer, in compact tags::

    <t>15,8</t><a>85</a>

The tags are ``<t>``/``<a>`` rather than ``<think>``/``<answer>`` because the model reads and writes one character
per token: the long tags alone would cost 32 generated tokens per completion, the compact ones 14.

Rewards follow the TRL signature ``f(prompts, completions, **columns) -> list[float | None]``: dataset columns
(here ``answer``) arrive as keyword lists, one entry per completion. See docs/demo.md for the formulas.

The train / held-out split is fixed (``SPLIT_SEED``) and independent of any run's seed, because the shipped
warm-up model was trained on the train side only: a run with another seed must still be evaluated on problems
the model has never seen. Both orders of a pair (``a+b`` and ``b+a``) always fall on the same side.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

LOW, HIGH = 10, 99  # operands are two-digit numbers, both ends included
SPLIT_SEED = 1234
NUM_HELDOUT = 500
MAX_COMPLETION_LENGTH = 24  # the longest well-formed completion, "<t>18,19</t><a>199</a>", is 22 characters

FORMAT_PATTERN = re.compile(r"<t>[^<>]*</t><a>[^<>]+</a>")
ANSWER_PATTERN = re.compile(r"<a>([^<>]*)</a>")


@dataclass(frozen=True)
class Problem:
    """One addition problem ``a + b``."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    def row(self) -> dict[str, str | int]:
        """The dataset row the trainer sees: the prompt, and the answer for the correctness reward."""
        return {"prompt": self.prompt, "answer": self.answer}


def all_problems(low: int = LOW, high: int = HIGH) -> list[Problem]:
    """Every ordered pair of operands in [low, high], in a fixed order."""
    return [Problem(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]


def split_problems(num_heldout: int = NUM_HELDOUT, seed: int = SPLIT_SEED) -> tuple[list[Problem], list[Problem]]:
    """Split all problems into (train, held_out) with no overlap, commuted pairs kept on one side.

    The unordered pairs are shuffled with ``seed``; pairs go to the held-out side until it holds ``num_heldout``
    problems (a pair ``a+b``/``b+a`` counts as two, ``a+a`` as one). Both lists are in a fixed, sorted order.
    """
    pairs = sorted({(min(p.a, p.b), max(p.a, p.b)) for p in all_problems()})
    random.Random(seed).shuffle(pairs)
    held_out: list[Problem] = []
    train: list[Problem] = []
    for x, y in pairs:
        side = held_out if len(held_out) < num_heldout else train
        side.extend({Problem(x, y), Problem(y, x)})
    return sorted(train, key=_order), sorted(held_out, key=_order)


def write_splits(folder: str | Path) -> tuple[Path, Path]:
    """Write train.jsonl and held_out.jsonl (one ``{"prompt", "answer"}`` row per line) for ``grpo train``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, problems in zip(("train", "held_out"), split_problems(), strict=True):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(p.row()) + "\n" for p in problems))
        paths.append(path)
    return paths[0], paths[1]


def _order(problem: Problem) -> tuple[int, int]:
    return (problem.a, problem.b)


def column_sums(a: int, b: int, carry: bool = True) -> tuple[int, int]:
    """(ones column sum, tens column sum); the tens sum includes the carry from the ones unless ``carry=False``."""
    ones = a % 10 + b % 10
    tens = a // 10 + b // 10 + (ones // 10 if carry else 0)
    return ones, tens


def format_completion(reasoning: str, answer: str) -> str:
    return f"<t>{reasoning}</t><a>{answer}</a>"


def solution(problem: Problem) -> str:
    """The correct, well-formed completion, e.g. ``"<t>15,8</t><a>85</a>"`` for 47+38."""
    ones, tens = column_sums(problem.a, problem.b)
    return format_completion(f"{ones},{tens}", str(problem.answer))


def extract_answer(completion: str) -> str | None:
    """The text inside the first ``<a>...</a>``, stripped; None when there is no such pair of tags."""
    match = ANSWER_PATTERN.search(completion)
    return match.group(1).strip() if match else None


def parse_int(text: str | None) -> int | None:
    """``text`` as an integer when it is a plain decimal number (optionally signed), otherwise None."""
    if text is None or not re.fullmatch(r"[+-]?\d+", text):
        return None
    return int(text)


def _text(completion: str | list[dict[str, str]]) -> str:
    # Conversational completions arrive as [{"role": "assistant", "content": ...}]; plain ones as strings.
    return completion if isinstance(completion, str) else completion[-1]["content"]


def format_reward(prompts: list, completions: list, **kwargs) -> list[float | None]:
    """+1.0 when the whole completion is ``<t>...</t><a>...</a>`` (answer not empty), -1.0 otherwise."""
    return [1.0 if FORMAT_PATTERN.fullmatch(_text(c).strip()) else -1.0 for c in completions]


def correctness_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the number inside ``<a>...</a>`` equals the ``answer`` column, 0.0 otherwise (missing, wrong)."""
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        got = parse_int(extract_answer(_text(completion)))
        rewards.append(1.0 if got is not None and got == int(expected) else 0.0)
    return rewards


REWARD_FUNCS = (format_reward, correctness_reward)


@torch.no_grad()
def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
    batch_size: int = 256,
    **generate_kwargs,
) -> list[str]:
    """Completions for ``prompts`` (greedy unless ``generate_kwargs`` say otherwise), batched with left padding.

    Special tokens are dropped from the decoded text; the model's train/eval mode and the tokenizer's padding
    side are restored afterwards.
    """
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    generate_kwargs = {"do_sample": False, **generate_kwargs}
    try:
        completions: list[str] = []
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True)
            batch = batch.to(model.device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **generate_kwargs,
            )
            new_tokens = out[:, batch["input_ids"].shape[1] :]  # (B, T_new)
            completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
        return completions
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)


def evaluate(
    model,
    tokenizer,
    problems: Sequence[Problem],
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
    batch_size: int = 256,
) -> float:
    """Held-out accuracy: the fraction of ``problems`` whose greedy completion earns correctness reward 1.0."""
    if not problems:
        raise ValueError("evaluate() needs at least one problem")
    prompts = [p.prompt for p in problems]
    completions = generate_texts(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    scores = correctness_reward(prompts, completions, answer=[p.answer for p in problems])
    return sum(scores) / len(scores)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the demo's train/held-out split as JSONL files.")
    parser.add_argument("--out", default="outputs/demo_data", help="Folder for train.jsonl and held_out.jsonl.")
    for written in write_splits(parser.parse_args().out):
        print(written)
