"""Supervised warm-up for the vision demo: a tiny Qwen2.5-VL that sees the colour but usually names its neighbour.

GRPO can only reinforce what the policy already samples. A random model never writes a colour's name, so every
group would score 0. This warm-up trains a random-init tiny Qwen2.5-VL (grpokit.tiny_vision, the family's own
classes and processor) on the vision task's training scenes with noisy labels: the shape's colour with probability
p_correct, the next colour of the wheel (vision_task.WHEEL) with p_other, else another colour. The warm model
therefore prefers the neighbour under greedy decoding, yet samples the right one often enough at
temperature 1 for GRPO to find it. The loss is the trainer's own log-prob pass (grpokit.passes), images included.
The result is shipped in grpokit/demo/vision_assets:

    python -m grpokit.demo.vision_warmup --out grpokit/demo/vision_assets
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

from grpokit.demo.vision_task import COLOURS, IMAGE_SIZE, Scene, encode, evaluate, sampling_profile, split_scenes


@dataclass
class VisionWarmupConfig:
    """Everything that decides the warm model; saved next to it as warmup.json."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 3
    vision_size: int = 64
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    p_correct: float = 0.25
    p_other: float = 0.7


def label(scene: Scene, config: VisionWarmupConfig, rng: random.Random) -> str:
    draw = rng.random()
    if draw < config.p_correct:
        return scene.answer
    if draw < config.p_correct + config.p_other:
        return scene.other
    return rng.choice([c for c in COLOURS if c not in (scene.answer, scene.other)])


def batch_tokens(tokenizer, encoded, targets: list[str]):
    """passes.Tokens of prompts and their target completions (the colour, then the end of the turn)."""
    from grpokit.passes import Tokens
    from grpokit.rollout.generate import left_pad

    prompt_ids, prompt_mask = left_pad([ids for ids, _ in encoded], tokenizer.pad_token_id)
    ends = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completions = [tokenizer(t, add_special_tokens=False)["input_ids"] + [ends] for t in targets]
    width = max(map(len, completions))
    ids = torch.full((len(completions), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(completions), width), dtype=torch.long)
    for row, c in enumerate(completions):
        ids[row, : len(c)], mask[row, : len(c)] = torch.tensor(c), 1
    return Tokens(prompt_ids, prompt_mask, ids, mask, tuple(v for _, v in encoded))


def warm_up(config: VisionWarmupConfig, log_every: int = 100):
    """The warm (model, processor) and its measurements."""
    from grpokit.passes import PassRequest, run_pass
    from grpokit.tiny_vision import tiny_qwen2_5_vl

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    model, processor = tiny_qwen2_5_vl(hidden_size=config.hidden_size, num_layers=config.num_layers,
                                       image_size=IMAGE_SIZE, seed=config.seed, vision_size=config.vision_size)
    train, held_out = split_scenes()
    encoded = encode(processor, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    started = time.perf_counter()
    for step in range(config.steps):
        picked = rng.sample(range(len(train)), config.batch_size)
        tokens = batch_tokens(processor.tokenizer, [encoded[i] for i in picked],
                              [label(train[i], config, rng) for i in picked])
        logp = run_pass(model, tokens, PassRequest()).logprobs
        loss = -(logp * tokens.completion_mask).sum() / tokens.completion_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{config.steps} loss {loss.item():.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    measured = {
        "train_seconds": round(time.perf_counter() - started, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out_accuracy": evaluate(model, processor, held_out),
        "sampling_profile": sampling_profile(model, processor, held_out),
    }
    return model, processor, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="grpokit/demo/vision_assets")
    parser.add_argument("--steps", type=int, default=VisionWarmupConfig.steps)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    from grpokit.tiny_vision import save

    config = VisionWarmupConfig(seed=cli.seed, steps=cli.steps)
    model, processor, measured = warm_up(config)
    out = save(model, processor, cli.out)
    (Path(out) / "warmup.json").write_text(json.dumps({"config": asdict(config), **measured}, indent=2) + "\n")
    print(json.dumps(measured, indent=2))


if __name__ == "__main__":
    main()
