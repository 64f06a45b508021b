"""Supervised warm-up for the tool demo: a tiny model that knows how to call the calculator, but mostly guesses.

The labels are noisy transcripts of the tool task (tools_task.py): in a minority of them (`p_tool`) the model calls
``calc`` and copies the result, sometimes miscopying the expression or the result; in the rest it guesses a
product, which is rarely right. The warm model therefore guesses under greedy decoding (few held-out answers
right) but samples tool calls often enough at temperature 1 for GRPO to find that they pay. Tool-result tokens
are context in these transcripts exactly as in a rollout, and never a label. The result ships in
grpokit/demo/tools_assets.

    python -m grpokit.demo.tools_warmup --out grpokit/demo/tools_assets
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.demo.tools_task import Problem, calc, evaluate, split_problems
from grpokit.demo.warmup import supervised_training, warmup_cli
from grpokit.tiny import char_tokenizer, tiny_qwen2


@dataclass
class ToolWarmupConfig:
    """Everything that decides the warm model; saved next to it as warmup.json."""

    seed: int = 0
    hidden_size: int = 96
    num_layers: int = 2
    num_heads: int = 3  # head size 32, which vLLM's CPU attention supports (grpo demo --task tools --use-vllm)
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    p_tool: float = 0.3
    """Share of transcripts that call the calculator; the rest guess."""
    p_miscopy: float = 0.15
    """Share of tool calls whose expression (or, as often, whose copied result) has one digit wrong."""
    p_lucky_guess: float = 0.05
    """Share of guesses that are the right product."""


def _one_digit_wrong(number: int, rng: random.Random) -> int:
    digits = list(str(number))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def transcript(problem: Problem, rng: random.Random, config: ToolWarmupConfig) -> list[tuple[str, bool]]:
    """One noisy episode as (text, written by the model) segments; a model segment ends its turn."""
    if rng.random() < config.p_tool:
        a, b = problem.a, problem.b
        if rng.random() < config.p_miscopy / 2:
            a = _one_digit_wrong(a, rng)
        result = int(calc(f"{a}*{b}"))
        answer = _one_digit_wrong(result, rng) if rng.random() < config.p_miscopy / 2 else result
        return [(f"<call>calc({a}*{b})</call>", True), (f"<result>{result}</result>", False), (f"<a>{answer}</a>", True)]
    guess = problem.answer
    if rng.random() >= config.p_lucky_guess:  # a plausible wrong product
        guess = max(100, problem.answer + rng.choice((-1, 1)) * rng.randint(1, 300))
        guess += guess == problem.answer
    return [(f"<a>{guess}</a>", True)]


def make_batch(tokenizer, problems: list[Problem], episodes: list[list[tuple[str, bool]]]):
    """(input_ids, attention_mask, labels), right-padded; labels only on the model's tokens (and its EOS)."""
    rows = []
    for problem, segments in zip(problems, episodes, strict=True):
        ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for text, by_model in segments:
            part = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if by_model else [])
            ids += part
            labels += part if by_model else [-100] * len(part)
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    label_ids = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        input_ids[i, : len(ids)], label_ids[i, : len(ids)], attention[i, : len(ids)] = (
            torch.tensor(ids), torch.tensor(labels), 1)
    return input_ids, attention, label_ids


def train(config: ToolWarmupConfig, log_every: int = 100):
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden_size=config.hidden_size, num_layers=config.num_layers,
                       num_heads=config.num_heads, seed=config.seed)
    train_problems, _ = split_problems()

    def next_batch():
        problems = rng.choices(train_problems, k=config.batch_size)
        return make_batch(tokenizer, problems, [transcript(p, rng, config) for p in problems])

    supervised_training(model, next_batch, config.steps, config.lr, config.warmup_steps, 0.01, log_every)
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    def measure(model, tokenizer) -> dict:
        return {"held_out_greedy": evaluate(model, tokenizer, split_problems()[1])}

    warmup_cli(__doc__.splitlines()[0], ToolWarmupConfig, Path(__file__).parent / "tools_assets", train, measure, argv)


if __name__ == "__main__":
    main()
