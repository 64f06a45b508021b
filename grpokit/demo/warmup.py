"""Supervised warm-up for the demo: a tiny model that knows the format and is only partly right.

GRPO can only reinforce what the policy already samples. A random-init model never writes ``<t>..</t><a>..</a>``,
so every group would score the same and learn nothing. This warm-up teaches the format and the column-sum
computation, but on deliberately noisy labels: for most examples the label is the classic "no carrying" mistake
(each column summed on its own, the carry forgotten), a few examples are malformed, and only a minority are
right. The warm model therefore prefers the mistake under greedy decoding, yet samples the right answer often
enough at temperature 1 for GRPO to find it and sharpen it. The result is shipped in ``grpokit/demo/assets``.

    python -m grpokit.demo.warmup --out grpokit/demo/assets
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from grpokit.demo.task import (
    Problem,
    column_sums,
    evaluate,
    format_completion,
    correctness_reward,
    format_reward,
    generate_texts,
    solution,
    split_problems,
)
from grpokit.tiny import char_tokenizer, tiny_qwen2


@dataclass
class WarmupConfig:
    """Everything that decides the warm model; saved next to it as warmup.json."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    steps: int = 3000
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    p_correct: float = 0.35
    """Share of well-formed labels that are correct; the rest make the no-carry mistake."""
    p_malformed: float = 0.1
    """Share of labels whose format is broken (tags missing or unclosed)."""


def no_carry_completion(problem: Problem) -> str:
    """The "no carrying" mistake: each column summed alone, e.g. ``<t>15,7</t><a>75</a>`` for 47+38."""
    ones, tens = column_sums(problem.a, problem.b, carry=False)
    return format_completion(f"{ones},{tens}", str(int(f"{tens % 10}{ones % 10}")))


def malformed(completion: str, rng: random.Random) -> str:
    """One of a few ways to break the format of a well-formed completion."""
    reasoning, answer = completion[3:].split("</t><a>")
    answer = answer.removesuffix("</a>")
    return rng.choice(
        [
            answer,  # bare answer
            f"<a>{answer}</a>",  # no reasoning
            f"<t>{reasoning}</t>{answer}",  # answer outside its tags
            f"<t>{reasoning}</t><a>{answer}",  # unclosed answer
            f"<t>{reasoning}<a>{answer}</a>",  # unclosed reasoning
        ]
    )


def noisy_completion(problem: Problem, rng: random.Random, p_correct: float, p_malformed: float) -> str:
    completion = solution(problem) if rng.random() < p_correct else no_carry_completion(problem)
    return malformed(completion, rng) if rng.random() < p_malformed else completion


def make_batch(
    tokenizer, problems: list[Problem], completions: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; labels are -100 on the prompt and the padding."""
    rows = []
    for problem, completion in zip(problems, completions, strict=True):
        prompt_ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids, completion_ids))
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (p, c) in enumerate(rows):
        ids = p + c
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(p) : len(ids)] = torch.tensor(c)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(config: WarmupConfig, log_every: int = 250):
    """Train the warm model on the train split; returns (model, tokenizer)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(
        len(tokenizer),
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        seed=config.seed,
    )
    train_problems, _ = split_problems()

    def next_batch():
        problems = rng.choices(train_problems, k=config.batch_size)
        completions = [noisy_completion(p, rng, config.p_correct, config.p_malformed) for p in problems]
        return make_batch(tokenizer, problems, completions)

    supervised_training(model, next_batch, config.steps, config.lr, config.warmup_steps, config.weight_decay,
                        log_every)
    return model, tokenizer


def supervised_training(model, next_batch, steps: int, lr: float, warmup_steps: int, weight_decay: float,
                        log_every: int = 0) -> None:
    """Next-token cross-entropy on the labelled tokens of `next_batch()` = (input_ids, attention_mask, labels),
    labels -100 where nothing is learned; AdamW, `lr_factor` schedule, gradients clipped at 1. Leaves eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, steps))
    model.train()
    for step in range(steps):
        input_ids, attention_mask, labels = next_batch()
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()


@torch.no_grad()
def sampling_profile(model, tokenizer, problems: list[Problem], num_generations: int = 8, seed: int = 0) -> dict:
    """How GRPO will see the model: at temperature 1, groups of ``num_generations`` samples per problem.

    Returns the share of well-formed samples, of correct samples, of groups with at least one correct sample
    (pass@G), and of groups whose total rewards are not all equal (only those carry a learning signal).
    """
    torch.manual_seed(seed)
    prompts = [p.prompt for p in problems for _ in range(num_generations)]
    answers = [p.answer for p in problems for _ in range(num_generations)]
    completions = generate_texts(
        model, tokenizer, prompts, batch_size=len(prompts), do_sample=True, temperature=1.0, top_k=0
    )
    fmt = torch.tensor(format_reward(prompts, completions)).view(-1, num_generations)
    correct = torch.tensor(correctness_reward(prompts, completions, answer=answers)).view(-1, num_generations)
    total = fmt + correct
    return {
        "well_formed": (fmt > 0).float().mean().item(),
        "correct": correct.mean().item(),
        "pass_at_g": (correct.max(dim=1).values > 0).float().mean().item(),
        "groups_with_signal": (total.std(dim=1) > 0).float().mean().item(),
    }


def main(argv: list[str] | None = None) -> None:
    def measure(model, tokenizer) -> dict:
        _, held_out = split_problems()
        return {
            "held_out_accuracy": evaluate(model, tokenizer, held_out),
            "sampling_profile": sampling_profile(model, tokenizer, held_out[::2]),  # every other one: a spread
        }

    warmup_cli(__doc__.splitlines()[0], WarmupConfig, Path(__file__).parent / "assets", train, measure, argv)


def warmup_cli(description: str, config_type: type, default_out: Path, train_fn, measure, argv=None) -> dict:
    """A warm-up's command line: one option per field of `config_type`, then train_fn(config) -> (model,
    tokenizer), deterministic; saves both to --out with warmup.json (the config, parameter count, train seconds
    and measure(model, tokenizer)), prints and returns that report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out)
    for name, value in asdict(config_type()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    config = config_type(**{k: v for k, v in vars(args).items() if k != "out"})
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model, tokenizer = train_fn(config)
    report = {
        "config": asdict(config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(time.perf_counter() - start, 1),
        **measure(model, tokenizer),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "warmup.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
